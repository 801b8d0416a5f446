"""Claims of the reconcile loop and rollout with no test before issue 36: a failed load is tried
again after 30 s, then 60, 120... (doubling, at most 600 s), on a real tritonserver, with the
controller's clock moved by the test; a rollout that finds no server fails and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.errors import RolloutError
from controller.reconcile import Controller
from controller.rollout import rollout
from exporter.pipeline import export_artifact
from repository.disk_store import DiskStateStore
from repository.layout import VERSION_CONFIGS
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import KEY, as_controlled, controlled_server, loaded
from tests.gateway.test_units import FakeClock

pytestmark = pytest.mark.slow


def test_a_failed_load_is_tried_again_after_30_s_then_doubling(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    # a version whose own config cannot load (each version runs under the config it was published
    # with: the model-level copy and the version's own)
    for path in (
        repo / "lt" / "configs" / "local.pbtxt",
        repo / "lt" / "1" / VERSION_CONFIGS / "configs" / "local.pbtxt",
    ):
        path.write_text(path.read_text().replace('backend: "python"', 'backend: "nope"'))
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    clock = FakeClock()
    cfg = ControllerConfig(load_timeout_s=60)
    assert cfg.retry_after_s == 30.0  # the default under test
    try:
        server.start()
        controller = Controller(DiskStateStore(repo), as_controlled([server]), KEY, cfg, clock=clock)

        def tried_at(offset: float) -> bool:
            clock.now = 1000.0 + offset
            return any(f.startswith("s: lt [1]:") for f in controller.reconcile_once().failures)

        attempts = [t for t in (0, 1, 29.9, 30, 31, 89.9, 90, 209.9, 210) if tried_at(t)]
        assert attempts == [0, 30, 90, 210]  # waits of 30, 60, 120 s
        assert loaded(server) == {}
        for _ in range(6):  # the wait stops doubling at 600 s
            clock.now += 600
            assert tried_at(clock.now - 1000.0)
        clock.now += 599
        assert not tried_at(clock.now - 1000.0)
    finally:
        server.stop()


def test_a_rollout_that_finds_no_server_fails_and_changes_nothing(
    small_artifact: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    store = DiskStateStore(repo)
    before = store.current("lt")
    with pytest.raises(RolloutError) as refused:
        rollout(store, "lt", 2, lambda: [], KEY)
    assert str(refused.value) == (
        "no server found to roll lt version 2 onto: check --servers, or the region's discovery "
        "(DNS name, EndpointSlices)"
    )
    after = store.current("lt")
    assert before is not None and after is not None
    assert (after.served, after.canary, after.generation) == (before.served, None, before.generation)
