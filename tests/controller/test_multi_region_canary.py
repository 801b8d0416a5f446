"""Issue 34, item 3: a canary is a canary everywhere. The regions a canary must pass are kept in its
record when it starts; each region's controller marks only its own region, whatever its own
configuration says, so with one region's controller down the canary is held, never promoted. On
two real tritonservers, one per region, each with its own controller."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from controller.fleet import ControlledServer
from controller.reconcile import Controller
from controller.rollout import rollout
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.controller.conftest import CFG, KEY, controlled_server, loaded, two_versions
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _in(server: TritonServer, region: str) -> Callable[[], list[ControlledServer]]:
    return lambda: [ControlledServer(f"{region}/{server.spec.name}", region, server.http_url)]


def test_a_region_whose_controller_is_down_holds_the_canary(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    store = two_versions(small_artifact, repo)
    east = controlled_server(repo, "e", tmp_path / "logs", prepared_triton)
    west = controlled_server(repo, "w", tmp_path / "logs", prepared_triton)
    try:
        east.start()
        west.start()
        for region, server in (("east", east), ("west", west)):
            Controller(store, _in(server, region), KEY, CFG).reconcile_once()
        # the rollout command of the east region: its servers pass, west is still to come
        result = rollout(store, "lt", 2, _in(east, "east"), KEY, CFG, regions=["east", "west"])
        assert result.observing and result.state.canary is not None
        assert result.state.served == [1]

        # east's controller, configured without canary regions (it used to promote on its own
        # servers alone): the record's regions hold it while west's controller is down
        east_controller = Controller(store, _in(east, "east"), KEY, CFG)
        for _ in range(3):
            report = east_controller.reconcile_once()
        state = store.current("lt")
        assert state is not None and state.canary is not None and state.served == [1], report.canary
        assert state.canary.regions_done == ["east"]
        assert any("waiting for west" in line for line in report.canary), report.canary
        assert loaded(east) == {"lt": [1, 2]} and loaded(west) == {"lt": [1]}

        # west's controller comes back: it checks its server, and the canary is promoted
        west_controller = Controller(store, _in(west, "west"), KEY, CFG)

        def promoted() -> bool:  # once the east check's canary lease (0.5 s here) has lapsed
            west_controller.reconcile_once()
            now = store.current("lt")
            return now is not None and now.canary is None

        wait_until(promoted, 60, "west's controller checked its server and promoted")
        state = store.current("lt")
        assert state is not None
        assert state.served == [2] and state.versions[2].state == "promoted"
        for _ in range(2):
            east_controller.reconcile_once()
            west_controller.reconcile_once()
        assert loaded(east) == {"lt": [2]} and loaded(west) == {"lt": [2]}
    finally:
        east.stop()
        west.stop()
