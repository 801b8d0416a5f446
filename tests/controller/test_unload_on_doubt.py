"""Issue 34, item 1: the controller never unloads on doubt. On a real tritonserver run by the
controller, a record that cannot be read, a listing that fails or comes back empty change nothing;
a model removed from the repository is unloaded only after `absent_passes_before_unload` passes."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest

from controller.reconcile import Controller
from exporter.pipeline import export_artifact
from repository.desired_state import STATE_FILE, DesiredState
from repository.disk_store import DiskStateStore
from repository.errors import NewerRecord
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, as_controlled, controlled_server, loaded, two_versions

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
        assert report.unloads == ["s: other unloaded (not in the repository)"] and report.loads == []
    finally:
        server.stop()


def test_a_record_from_a_newer_controller_is_served_and_never_downgraded(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    store = two_versions(small_artifact, repo)
    state = store.current("lt")
    assert state is not None and state.served == [1]
    record = repo / "lt" / STATE_FILE

    # a field this controller does not know (a newer controller's, same format): kept on writes
    raw = json.loads(record.read_text())
    raw["placement_hints"] = {"prefer": "gpu"}
    raw["versions"]["1"]["signed_by"] = "ci"
    record.write_text(json.dumps(raw))
    store.update("lt", partial(DesiredState.start_canary, version=2))
    kept = json.loads(record.read_text())
    assert kept["placement_hints"] == {"prefer": "gpu"} and kept["versions"]["1"]["signed_by"] == "ci"
    assert kept["canary"]["version"] == 2

    # a newer format: served as it says, never written (a canary in it is the newer controller's)
    kept["format"] = 2
    record.write_text(json.dumps(kept))
    before = record.read_bytes()
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    try:
        server.start()
        controller = Controller(store, as_controlled([server]), KEY, CFG)
        for _ in range(3):
            report = controller.reconcile_once()
        assert loaded(server) == {"lt": [1]}
        assert any("format 2 (a newer controller's)" in f for f in report.failures), report.failures
        assert record.read_bytes() == before
        with pytest.raises(NewerRecord, match="has format 2, written by a newer skewserve controller"):
            store.update("lt", partial(DesiredState.rollback))
    finally:
        server.stop()
