"""Issue 34, item 6: the controller's API is authenticated and bounded. On a real tritonserver with
a canary holding a traffic share: one forged report (1,000 fast error-free answers under a new
reporter name) promoted the canary before; now it is refused without a caller's token, a caller
adds only to its own tallies, reports of models not in canary and asks naming other regions keep
nothing, and /healthz, /readyz and /metrics answer without a token."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from controller.api_auth import CallerTokens
from controller.fleet import FleetSpec
from controller.runner import ControllerThread
from gateway.config import RegionConfig, ServerConfig
from gateway.fleet.traffic_tally import ModelTally, RoleTally, TrafficReport
from repository.desired_state import DesiredState, TrafficGate
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, controlled_server, two_versions
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
TOKEN = "gateway-token-for-the-test-0001"
OTHER = "another-callers-token-0000000002"


def _post(url: str, body: Any, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _forged(model: str, version: int, started: float, reporter: str) -> dict[str, Any]:
    canary, stable = RoleTally(), RoleTally()
    for _ in range(1000):
        canary.observe(0.001, True)
        stable.observe(0.001, True)
    tally = ModelTally(version=version, started=started)
    tally.roles.update({"canary": canary, "stable": stable})
    return json.loads(TrafficReport(reporter=reporter, models={model: tally}).model_dump_json())


def test_forged_reports_and_asks_change_nothing_without_a_callers_token(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    store = two_versions(small_artifact, repo)
    gate = TrafficGate(min_requests=500, max_p99_ratio=1e6)
    store.update("lt", partial(DesiredState.start_canary, version=2, share=0.1, gate=gate))
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "gateway-r").write_text(TOKEN)
    (tokens / "gateway-other").write_text(OTHER)
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    thread = None
    try:
        server.start()
        fleet = FleetSpec(
            [
                RegionConfig(
                    name="r",
                    servers=[ServerConfig(name="s", http=server.http_address, grpc=server.grpc_address)],
                )
            ]
        )
        thread = ControllerThread(fleet, store, KEY, CFG).start()
        api = f"http://127.0.0.1:{thread.serve_demand('127.0.0.1', 0, CallerTokens(tokens))}"
        plans = thread.controller
        wait_until(lambda: "lt" in plans.traffic_plans, 120, "the canary passed its server check")
        started = float(plans.traffic_plans["lt"]["started"])

        forged = _forged("lt", 2, started, "invented-reporter")
        for token in (None, "not-a-token-of-any-caller-000000"):
            status, answer = _post(f"{api}/v1/traffic", forged, token)
            assert (status, answer["state"]) == (401, "unauthorized"), answer
            assert "Authorization: Bearer" in answer["reason"]
        status, answer = _post(f"{api}/v1/demand", {"model": "lt"})
        assert status == 401, answer
        seen = thread.passes
        wait_until(lambda: thread.passes >= seen + 3, 60, "three passes")  # the gate had its chances
        state = store.current("lt")
        assert state is not None and state.canary is not None and state.served == [1]
        assert plans.traffic.total("lt", 2, started).roles["canary"].requests == 0

        # a caller's reports are filed under its name: the same reporter name from another caller
        # neither replaces nor doubles them; the sum counts each caller's latest once
        half = _forged("lt", 2, started, "worker-1")
        half["models"]["lt"]["roles"]["canary"]["requests"] = 300
        assert _post(f"{api}/v1/traffic", half, TOKEN)[0] == 200
        assert _post(f"{api}/v1/traffic", half, TOKEN)[0] == 200  # cumulative: replaces its own
        assert _post(f"{api}/v1/traffic", half, OTHER)[0] == 200
        assert plans.traffic.total("lt", 2, started).roles["canary"].requests == 600

        # models not in canary and invented ones are not kept; asks for invented regions refused
        invented = {"reporter": "w", "models": {f"m{i}": {"version": 1, "started": 1.0} for i in range(500)}}
        status, answer = _post(f"{api}/v1/traffic", invented, TOKEN)
        assert status == 200 and set(answer["models"]) == {"lt"}
        assert {key[0] for key in plans.traffic._latest} == {"lt"}
        status, answer = _post(f"{api}/v1/demand", {"model": "lt", "region": "mars"}, TOKEN)
        assert status == 400 and "one of the fleet's regions (r)" in answer["reason"], answer
        assert not any(region == "mars" for region, _ in plans.requested)

        # probes and metrics need no token
        assert _get(f"{api}/healthz")[0] == 200
        status, ready = _get(f"{api}/readyz")
        assert status == 200 and json.loads(ready)["state"] == "leader"
        status, metrics = _get(f"{api}/metrics")
        assert status == 200
        assert 'skewserve_controller_server_models{server="r/s"} 1.0' in metrics
        assert "skewserve_controller_passes_total" in metrics and "skewserve_controller_leader 1.0" in metrics
    finally:
        if thread is not None:
            thread.stop()
        server.stop()
