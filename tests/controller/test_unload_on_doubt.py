"""Issue 34, item 1: the controller never unloads on doubt. On a real tritonserver run by the
controller, a record that cannot be read, a listing that fails or comes back empty change nothing;
a model removed from the repository is unloaded only after `absent_passes_before_unload` passes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from controller.desired_state import DesiredState
from controller.reconcile import Controller
from controller.state_store import DiskStateStore
from exporter.pipeline import export_artifact
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, as_controlled, controlled_server, loaded

pytestmark = pytest.mark.slow


class FaultyStore(DiskStateStore):
    """The disk store with faults the test turns on: reads of some models fail (an S3 503, a
    timeout, a record from a newer writer), the listing fails or lists nothing."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.unreadable: set[str] = set()
        self.listing: str = "ok"  # ok | empty | error

    def read(self, model: str) -> tuple[DesiredState | None, object]:
        if model in self.unreadable:
            raise OSError(f"injected: 503 SlowDown reading {model}")
        return super().read(model)

    def models(self) -> list[str]:
        if self.listing == "error":
            raise OSError("injected: listing timed out")
        return [] if self.listing == "empty" else super().models()


def test_a_model_is_unloaded_only_when_confirmed_gone_never_on_a_failed_read(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    for name in ("lt", "other"):
        export_artifact(small_artifact, repo, name, tensorrt="off")
    store = FaultyStore(repo)
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    everything = {"lt": [1], "other": [1]}
    try:
        server.start()
        controller = Controller(store, as_controlled([server]), KEY, CFG)
        controller.reconcile_once()
        assert loaded(server) == everything

        store.unreadable = {"lt"}
        for _ in range(CFG.absent_passes_before_unload + 1):
            report = controller.reconcile_once()
            assert loaded(server) == everything, report
        assert any(f.startswith("lt: desired state unreadable: injected: 503") for f in report.failures)
        store.unreadable = set()

        for fault, said in (("empty", "came back empty"), ("error", "listing failed: injected")):
            store.listing = fault
            for _ in range(CFG.absent_passes_before_unload + 1):
                report = controller.reconcile_once()
                assert loaded(server) == everything, (fault, report)
            assert any(said in f and "nothing unloaded" in f for f in report.failures), report.failures
        store.listing = "ok"

        shutil.rmtree(repo / "other")  # really gone: unloaded once confirmed, and only then
        needed = CFG.absent_passes_before_unload
        for seen in range(1, needed):
            report = controller.reconcile_once()
            assert loaded(server) == everything
            assert report.absent == [f"other: not listed ({seen}/{needed} passes before unloading)"]
        store.listing = "error"  # a failed listing between confirmations neither counts nor resets
        controller.reconcile_once()
        store.listing = "ok"
        report = controller.reconcile_once()
        assert loaded(server) == {"lt": [1]}
        assert report.loads == ["s: other unloaded (not in the repository)"]
    finally:
        server.stop()
