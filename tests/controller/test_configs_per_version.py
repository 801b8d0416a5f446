"""Issue 34, item 4: a version runs under the config it was published with. Publishing a version
that is not served leaves the served version's configs in place (each version keeps its own beside
its files); the canary check loads the candidate under its own config; promotion writes the
candidate's configs to the model's place, pinned to it. On a real tritonserver (local profile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.reconcile import Controller
from controller.rollout import rollback, rollout
from controller.triton_admin import TritonAdmin
from exporter.pipeline import export_artifact
from exporter.triton_config import ConfigOptions
from repository.desired_state import TrafficGate
from repository.disk_store import DiskStateStore
from repository.errors import StateConflict
from repository.layout import VERSION_CONFIGS
from repository.model_config import parse
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, as_controlled, controlled_server, loaded

pytestmark = pytest.mark.slow
CONFIGS = ("config.pbtxt", "configs/local.pbtxt")


def _batch_and_pin(path: Path) -> tuple[int, list[int]]:
    cfg = parse(path.read_text())
    return cfg.max_batch_size, list(cfg.version_policy.specific.versions)


def test_a_version_runs_under_the_config_it_was_published_and_checked_with(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    model = repo / "lt"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")  # max_batch_size 64, served at once
    export_artifact(small_artifact, repo, "lt", tensorrt="off", options=ConfigOptions(max_batch_size=16))
    for rel in CONFIGS:  # the served version's configs stay where servers read them
        assert _batch_and_pin(model / rel) == (64, [1]), rel
        assert parse((model / "2" / VERSION_CONFIGS / rel).read_text()).max_batch_size == 16
    store = DiskStateStore(repo)
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    admin = None
    try:
        server.start()
        servers = as_controlled([server])
        Controller(store, servers, KEY, CFG).reconcile_once()
        admin = TritonAdmin("s", server.http_address, KEY, 120)
        assert admin.config("lt")["max_batch_size"] == 64  # type: ignore[index]

        # in canary (a share keeps it loaded until the gate decides): the candidate's own config
        waiting = TrafficGate(min_requests=10**6, max_wait_s=3600)
        result = rollout(store, "lt", 2, servers, KEY, CFG, share=0.5, gate=waiting)
        assert result.observing and loaded(server) == {"lt": [1, 2]}
        assert admin.config("lt")["max_batch_size"] == 16  # type: ignore[index]
        rollback(store, "lt", 1, servers, KEY, CFG)  # the canary ends: back on 1, under its own
        assert loaded(server) == {"lt": [1]} and admin.config("lt")["max_batch_size"] == 64  # type: ignore[index]
        for rel in CONFIGS:
            assert _batch_and_pin(model / rel) == (64, [1]), rel

        # promoted: the candidate's configs, pinned to it, are what every server reads from now on
        result = rollout(store, "lt", 2, servers, KEY, CFG)
        assert result.state.served == [2]
        for rel in CONFIGS:
            assert _batch_and_pin(model / rel) == (16, [2]), rel
        Controller(store, servers, KEY, CFG).reconcile_once()
        assert loaded(server) == {"lt": [2]} and admin.config("lt")["max_batch_size"] == 16  # type: ignore[index]
    finally:
        if admin is not None:
            admin.close()
        server.stop()


def test_a_writer_acting_on_an_older_record_never_leaves_a_stale_pin(
    small_artifact: Path, tmp_path: Path
) -> None:
    """Item 7: config writes are conditional and follow the newest record. A controller holding
    the record from before a promotion (it read it, then another controller promoted) writes the
    configs from the record as it is now, not as it read it."""
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    export_artifact(small_artifact, repo, "lt", tensorrt="off", options=ConfigOptions(max_batch_size=16))
    store = DiskStateStore(repo)
    before = store.current("lt")
    assert before is not None and before.served == [1]
    store.update("lt", lambda state: state.promote(2))  # another controller promotes meanwhile
    for rel in CONFIGS:
        assert _batch_and_pin(repo / "lt" / rel) == (16, [2]), rel
    store.materialize(before)  # the slower controller, with its older record
    for rel in CONFIGS:
        assert _batch_and_pin(repo / "lt" / rel) == (16, [2]), rel
    token = store.model_file_token("lt", "config.pbtxt")
    with pytest.raises(StateConflict, match="changed since it was read"):
        store.write_config("lt", "config.pbtxt", "name: 'lt'", "a-token-read-before-a-change")
    assert store.model_file_token("lt", "config.pbtxt") == token
