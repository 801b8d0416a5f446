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
from controller.triton_admin import TritonAdmin
from repository.desired_state import DesiredState, TrafficGate
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, controlled_server, controller_and_gateway, two_versions
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
