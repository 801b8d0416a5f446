"""While a model is in canary, a client that named no version is answered by the stable version or
not at all: when a reload leaves the stable version listed on no server (Triton unloads, then
loads), the gateway waits for it within the request's deadline and says so, and never lets Triton
answer from its newest loaded version, the candidate. (The rare-class shadow test caught a client
answered by a failed candidate that way in 2 of 4 clean-clone runs.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from controller.config import ControllerConfig
from controller.fleet import ControlledServer
from controller.reconcile import Controller, PassReport
from controller.triton_admin import TritonAdmin
from repository.desired_state import DesiredState, TrafficGate
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import (
    CFG,
    KEY,
    as_controlled,
    controlled_server,
    controller_and_gateway,
    loaded,
    two_versions,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _infer(http: str, timeout_ms: int) -> tuple[int, dict[str, str]]:
    body = {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
    headers = {"Content-Type": "application/json", "x-skewserve-timeout-ms": str(timeout_ms)}
    req = urllib.request.Request(f"http://{http}/v2/models/lt/infer", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_unversioned_requests_never_reach_the_candidate_while_the_stable_version_reloads(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    store = two_versions(small_artifact, repo)
    never = TrafficGate(min_requests=10**6, max_wait_s=3600)  # the canary stays on for the test
    store.update("lt", partial(DesiredState.start_canary, version=2, shadow=0.01, gate=never))
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    # one pass (it checks the canary there, so the server holds 1 and 2), then none unasked: this
    # test makes the reload gap itself
    cfg = ControllerConfig(**{**CFG.model_dump(), "interval_s": 3600.0})
    try:
        server.start()
        with controller_and_gateway([server], store, cfg, tmp_path / "gw", traffic={}) as (_, gw):
            wait_until(lambda: gw.server("s")["models"].get("lt") == ["1", "2"], 60, "1 and 2 listed")
            wait_until(lambda: "lt" in gw.admin()["traffic"]["models"], 30, "the gateway follows the canary")
            admin = TritonAdmin("s", server.http_address, KEY, 120)
            try:
                admin.load("lt", [2])  # the reload's gap: only the candidate is loaded
                wait_until(lambda: gw.server("s")["models"].get("lt") == ["2"], 30, "only 2 listed")
                status, answer = _infer(gw.http, 1500)
                assert status in (503, 504), answer  # no answer rather than the candidate's
                assert "version 1" in answer["error"], answer
                admin.load("lt", [1, 2])
                wait_until(lambda: gw.server("s")["models"].get("lt") == ["1", "2"], 30, "1 listed again")
                status, answer = _infer(gw.http, 5000)
                assert status == 200 and answer["model_version"] == "1", answer
                assert np.isfinite(answer["outputs"][0]["data"]).all()
            finally:
                admin.close()
    finally:
        server.stop()


class _Watched(Controller):
    """A controller that records the plans a gateway polling /v1/traffic would get while a pass
    observes the servers (the poll is answered from `traffic_plans` at any moment)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seen_while_observing: list[dict[str, dict[str, object]]] = []

    def _observe(self, server: ControlledServer, report: PassReport) -> list[dict[str, object]] | None:
        self.seen_while_observing.append(dict(self.traffic_plans))
        return super()._observe(server, report)


def test_a_failed_canary_stays_pinned_away_while_the_next_pass_observes_the_servers(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    """The pass after a canary failed drops its plan before it has seen that a server still holds
    the candidate: a gateway polling in that gap went unpinned, and Triton answered a client from
    the failed version (the rare-class shadow test, in a CI run)."""
    repo = tmp_path / "repo"
    store = two_versions(small_artifact, repo)
    never = TrafficGate(min_requests=10**6, max_wait_s=3600)
    store.update("lt", partial(DesiredState.start_canary, version=2, shadow=0.5, gate=never))
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    try:
        server.start()
        controller = _Watched(store, as_controlled([server]), KEY, CFG)
        controller.reconcile_once()  # checks the canary: the server holds 1 and 2, the gateways shadow
        assert loaded(server) == {"lt": [1, 2]}
        assert controller.traffic_plans["lt"]["canary"] == 2
        store.update("lt", partial(DesiredState.canary_failed, server="gate", reason="traffic gate"))
        controller.seen_while_observing.clear()
        controller.reconcile_once()  # observes 1 and 2 held, then unloads 2
        pin = {"stable": 1, "canary": 1, "share": 0.0, "shadow": 0.0, "started": 0.0}
        assert controller.seen_while_observing == [{"lt": pin}]
        assert controller.traffic_plans == {"lt": pin}
        assert loaded(server) == {"lt": [1]}
        controller.reconcile_once()  # nothing but 1 held: the pin goes
        assert controller.traffic_plans == {}
    finally:
        server.stop()
