"""The fleet serves what was promoted: desired state applied by the controller to real servers.

Servers run as in deploy/: explicit model control with nothing loaded at start, the
model-repository API behind the control key, --strict-readiness=false. Traffic goes through a real
gateway in front of them while versions are promoted and rolled back.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from controller.fleet import ControlledServer
from controller.reconcile import Controller
from controller.rollout import rollback, rollout
from exporter.pipeline import export_artifact
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, stop_servers
from tests.controller.conftest import CFG, KEY, as_controlled, controlled_server, loaded
from tests.gateway.conftest import gateway_config, launch_gateway
from tests.gateway.steady_load import SteadyLoad
from tests.waiting import wait_until


@pytest.mark.slow
def test_promotion_reaches_every_server_and_a_rollback_survives_a_restart(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo, logs = tmp_path / "repo", tmp_path / "logs"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    store = DiskStateStore(repo)
    first = [controlled_server(repo, n, logs, prepared_triton) for n in ("a", "b")]
    servers: list[TritonServer] = []
    outside: list[TritonServer] = []  # started, not (yet) in `servers`: stopped at the end too
    gw = None
    try:
        for s in first:
            servers.append(s.start())
        controller = Controller(store, as_controlled(servers), KEY, CFG)
        controller.reconcile_once()
        assert [loaded(s) for s in servers] == [{"lt": [1]}] * 2

        # published, not promoted: a server started afterwards serves the promoted version
        export_artifact(small_artifact, repo, "lt", tensorrt="off")
        state = store.current("lt")
        assert state is not None and state.served == [1] and state.versions[2].state == "published"
        servers.append(controlled_server(repo, "late", logs, prepared_triton).start())
        controller.reconcile_once()
        assert [loaded(s) for s in servers] == [{"lt": [1]}] * 3

        gw = launch_gateway(
            gateway_config({"r": list(servers)}, home="r", cache={"models": []}), tmp_path / "gw"
        )
        wait_until(lambda: all(s["models"] for s in gw.admin()["servers"]), 30, "gateway sees lt")
        out_of_rotation: list[str] = []
        watching = threading.Event()

        def watch_rotation() -> None:
            # What the rollout itself could do: leave a server without a ready lt. A health probe
            # that times out once on a loaded machine is not the rollout's doing (the clients'
            # answers, all checked by SteadyLoad, show whether serving ever stopped).
            while not watching.wait(0.05):
                for s in gw.admin()["servers"]:
                    if "lt" not in s["models"]:
                        out_of_rotation.append(f"{s['name']}: {s}")

        watcher = threading.Thread(target=watch_rotation)
        load = SteadyLoad(gw.http).start()
        watcher.start()
        # a server that appears mid-rollout (here: once the first server passed) is checked too; it
        # appears in the rollout's own discovery, so no thread race decides whether it is seen
        joiner = controlled_server(repo, "joiner", logs, prepared_triton)
        outside.append(joiner)
        joiner.start()

        def first_passed() -> bool:
            st = store.current("lt")
            return st is not None and st.canary is not None and bool(st.canary.passed)

        known, joining = as_controlled(servers), as_controlled([joiner])
        joined = threading.Event()

        def discover() -> list[ControlledServer]:
            if joined.is_set() or first_passed():
                joined.set()  # once found, it stays found (the canary ends with it)
                return known() + joining()
            return known()

        result: dict[str, Any] = {}
        rolling = threading.Thread(
            target=lambda: result.update(done=rollout(store, "lt", 2, discover, KEY, CFG))
        )
        rolling.start()
        rolling.join(timeout=300)
        servers.append(joiner)
        assert joined.is_set(), "the rollout never looked for servers after its first one passed"
        done = result["done"]
        assert done.state.served == [2] and done.state.versions[1].state == "retired"
        assert sum("joiner: lt version 2 ready in" in step for step in done.steps) == 1, done.steps
        controller.reconcile_once()
        assert [loaded(s) for s in servers] == [{"lt": [2]}] * 4

        state = rollback(store, "lt", None, as_controlled(servers), KEY, CFG)
        assert state.served == [1] and state.versions[2].state == "retired"
        assert [loaded(s) for s in servers] == [{"lt": [1]}] * 4
        load.stop()
        watching.set()
        watcher.join()
        assert load.failed == [] and load.ok > 0
        assert out_of_rotation == []

        # the rollback is desired state, not a server's memory: a restarted server comes back on it
        servers[0].stop()
        servers[0].start()
        assert loaded(servers[0]) == {}
        controller.reconcile_once()
        assert loaded(servers[0]) == {"lt": [1]}
    finally:
        if gw is not None:
            gw.stop()
        stop_servers(servers + first + outside)
