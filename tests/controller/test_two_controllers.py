"""Two controllers (a rollout command's and a running one, or two replicas without leader
election) passing over the same canary at once, with the default 30 s canary lease: every server
is checked exactly once, by whichever holds the lease, and the version is promoted. On two real
tritonservers."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.reconcile import Controller
from repository.desired_state import DesiredState
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import start_servers, stop_servers
from tests.controller.conftest import KEY, as_controlled, controlled_server, loaded, two_versions

pytestmark = pytest.mark.slow
REALISTIC = ControllerConfig(interval_s=0.2, lease_s=30.0, retry_after_s=0.2, load_timeout_s=120)


def test_two_controllers_at_once_check_each_server_once(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    store = two_versions(small_artifact, repo)
    servers = [controlled_server(repo, name, tmp_path / "logs", prepared_triton) for name in ("a", "b")]
    try:
        start_servers(servers)
        controllers = [Controller(store, as_controlled(servers), KEY, REALISTIC) for _ in range(2)]
        controllers[0].reconcile_once()
        store.update("lt", partial(DesiredState.start_canary, version=2))
        done = threading.Event()
        errors: list[BaseException] = []

        def run(controller: Controller) -> None:
            try:
                while not done.is_set():
                    controller.reconcile_once()
                    state = store.current("lt")
                    if state is not None and state.canary is None:
                        done.set()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)
                done.set()

        threads = [threading.Thread(target=run, args=(c,)) for c in controllers]
        for t in threads:
            t.start()
        assert done.wait(300), "the canary did not finish"
        for t in threads:
            t.join(60)
        assert not errors, errors
        state = store.current("lt")
        assert state is not None and state.served == [2] and state.versions[2].state == "promoted"
        checks = [line for c in controllers for line in c.canary_log if "ready in" in line]
        checked = sorted(line.split(":")[0] for line in checks)
        assert checked == ["a", "b"], checks  # each server once, whoever held the lease
        for c in controllers:
            c.reconcile_once()
        assert all(loaded(s) == {"lt": [2]} for s in servers)
    finally:
        stop_servers(servers)
