"""A canary whose check fails on a real tritonserver: the version is marked failed and the server
goes back to the served version. The check runs in a thread of its own (it renews the canary lease
beside it); putting the server back afterwards must not reuse that thread's HTTP client
(geventhttpclient raises "cannot switch to a different thread" once that thread has exited)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from controller.reconcile import Controller
from exporter.pipeline import export_artifact
from repository.desired_state import DesiredState
from repository.disk_store import DiskStateStore
from repository.layout import CARD
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, as_controlled, controlled_server, loaded

pytestmark = pytest.mark.slow


def test_a_canary_failing_its_check_is_failed_and_the_server_goes_back(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    card_path = repo / "lt" / "2" / CARD
    card = json.loads(card_path.read_text())
    # the reference answers no longer match what version 2 computes: its check must fail
    card["canary"]["outputs"]["probabilities"] = [
        [1.0 - p for p in row] for row in card["canary"]["outputs"]["probabilities"]
    ]
    card_path.write_text(json.dumps(card))
    store = DiskStateStore(repo)
    store.update("lt", partial(DesiredState.start_canary, version=2))
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    try:
        server.start()
        controller = Controller(store, as_controlled([server]), KEY, CFG)
        report = controller.reconcile_once()
        state = store.current("lt")
        assert state is not None and state.canary is None, (report.failures, report.canary)
        assert state.versions[2].state == "failed" and "differs from the exporter's reference" in (
            state.versions[2].reason
        )
        assert any("back on version(s) 1" in line for line in report.canary), report.canary
        assert loaded(server) == {"lt": [1]}
    finally:
        server.stop()
