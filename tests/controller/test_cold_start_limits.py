"""Cold starts through several real gateway processes against one real controller, with loads held
open by the test: a model whose Triton load waits for a gate file, so every request is known to wait
for the load while it runs, and the outcomes are observed, not timed.

- single flight: concurrent first requests through two gateways of two workers each cause one load
  in the fleet and at most one ask per worker at the controller (`DemandApi.asks`);
- `cold_start.max_waiting`: a request beyond it is refused at once (503, Retry-After) naming it;
- `cold_start.wait_s`: a request waits at most that long, then 503 "still loading".
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.api_auth import CallerTokens
from controller.config import ControllerConfig
from controller.demand_api import DemandApi
from controller.fleet import FleetSpec
from controller.placement import CopyBounds, PlacementConfig
from controller.runner import ControllerThread
from gateway.config import RegionConfig, ServerConfig
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, start_servers, stop_servers
from tests.controller.conftest import GATEWAY_TOKEN, KEY, controlled_server
from tests.fixtures_models import write_affine_model
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway
from tests.waiting import wait_until

BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
).encode()

# OUTPUT0 = INPUT0 * 2 + 1, as the affine model, but its load ends only once the gate file exists.
GATED_MODEL_PY = """
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils

GATE = {gate!r}


class TritonPythonModel:
    def initialize(self, args):
        for _ in range(2400):  # bounded (120 s): a test that never opens the gate still ends
            if os.path.exists(GATE):
                return
            time.sleep(0.05)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = (x * 2.0 + 1.0).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses
"""


def write_gated_model(repo: Path, name: str, gate: Path) -> None:
    write_affine_model(repo, name)
    (repo / name / "1" / "model.py").write_text(GATED_MODEL_PY.format(gate=str(gate)))


def _infer(http: str, model: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        f"http://{http}/v2/models/{model}/infer", BODY, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def _inflight(gw: GatewayUnderTest) -> float:
    """Requests in flight through the gateway, summed over its workers (a gauge per worker)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in gw.metrics().splitlines()
        if line.startswith("skewserve_gateway_inflight")
    )


def _loads(servers: list[TritonServer], model: str) -> int:
    return "".join(s.log_text() for s in servers).count(f"successfully loaded '{model}'")


class Fleet:
    """The controller over real servers (one region, `r`) with its demand API, and the gateways
    the test launches against it."""

    def __init__(self, servers: list[TritonServer], thread: ControllerThread, workdir: Path) -> None:
        self.servers = servers
        self.thread = thread
        self.workdir = workdir
        self.gateways: list[GatewayUnderTest] = []
        tokens = workdir / "controller-tokens"
        tokens.mkdir(parents=True, exist_ok=True)
        (tokens / "gateway-r").write_text(GATEWAY_TOKEN)
        self.token_file = tokens / "gateway-r"
        self.url = f"http://127.0.0.1:{thread.serve_demand('127.0.0.1', 0, CallerTokens(tokens))}"

    @property
    def api(self) -> DemandApi:
        assert self.thread.demand_api is not None
        return self.thread.demand_api

    def gateway(self, workers: int = 1, **cold_start: Any) -> GatewayUnderTest:
        ask = {"controller_url": self.url, "token_file": str(self.token_file), **cold_start}
        cfg = gateway_config({"r": self.servers}, home="r", cache={"models": []}, cold_start=ask)
        cfg["listen"]["workers"] = workers
        gw = launch_gateway(cfg, self.workdir / f"gw{len(self.gateways)}")
        self.gateways.append(gw)
        return gw


@contextlib.contextmanager
def controlled_fleet(tmp_path: Path, prepared: PreparedTriton, gated: list[str]) -> Iterator[Fleet]:
    """Two servers, a served model `a` and the `gated` models (no copy needed; each loads once
    `tmp_path / f"open-{name}"` exists), under placement by demand."""
    repo = tmp_path / "repo"
    write_affine_model(repo, "a")
    for name in gated:
        write_gated_model(repo, name, tmp_path / f"open-{name}")
    store = DiskStateStore(repo)
    footprint = int(store.version_bytes("a", 1) * 1.5)
    placement = PlacementConfig(
        server_capacity_bytes=footprint * (len(gated) + 2),
        target_rps_per_copy=1000,  # one copy serves every request here: a second load is a defect
        recent_use_guard_s=60,
        models={name: CopyBounds(min_copies=0) for name in gated},
    )
    cfg = ControllerConfig(interval_s=0.5, load_timeout_s=120, placement=placement)
    servers = [controlled_server(repo, n, tmp_path / "logs", prepared) for n in ("s0", "s1")]
    fleet: Fleet | None = None
    thread: ControllerThread | None = None
    try:
        start_servers(servers)
        fleet_spec = FleetSpec(
            [
                RegionConfig(
                    name="r",
                    servers=[
                        ServerConfig(name=s.spec.name, http=s.http_address, grpc=s.grpc_address)
                        for s in servers
                    ],
                )
            ]
        )
        thread = ControllerThread(fleet_spec, store, KEY, cfg).start()
        fleet = Fleet(servers, thread, tmp_path)
        assert thread.wait_first_pass(120)
        yield fleet
    finally:
        for name in gated:  # a load still held must end for the servers to stop
            (tmp_path / f"open-{name}").touch()
        if fleet is not None:
            for gw in fleet.gateways:
                gw.stop()
        if thread is not None:
            thread.stop()
        stop_servers(servers)


@pytest.mark.slow
def test_first_requests_through_two_gateways_of_two_workers_cause_one_load(
    tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    with controlled_fleet(tmp_path, prepared_triton, ["cold"]) as fleet:
        gateways = [fleet.gateway(workers=2), fleet.gateway(workers=2)]
        asks = fleet.api.asks
        answers: list[tuple[int, dict[str, str], bytes]] = []
        n = 24
        clients = [
            threading.Thread(target=lambda gw=gateways[i % 2]: answers.append(_infer(gw.http, "cold")))
            for i in range(n)
        ]
        for c in clients:
            c.start()
        # every request is in a gateway, waiting for the one load the gate holds open
        wait_until(lambda: sum(_inflight(gw) for gw in gateways) == n, 120, f"{n} requests waiting")
        wait_until(lambda: "loading: cold:1" in "".join(s.log_text() for s in fleet.servers), 60, "the load")
        assert _loads(fleet.servers, "cold") == 0
        (tmp_path / "open-cold").touch()
        for c in clients:
            c.join()
        assert [a[0] for a in answers] == [200] * n, answers
        assert all(json.loads(a[2])["outputs"][0]["data"] == [3.0] * 4 for a in answers)
        assert _loads(fleet.servers, "cold") == 1  # one load in the whole fleet
        # the requests of a worker share its ask: at most one per worker of the two gateways
        assert 1 <= fleet.api.asks - asks <= 4, fleet.api.asks - asks


@pytest.mark.slow
def test_max_waiting_refuses_at_once_and_wait_s_bounds_the_wait(
    tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    with controlled_fleet(tmp_path, prepared_triton, ["held", "slow"]) as fleet:
        _max_waiting_refuses_at_once(fleet, tmp_path)
        _wait_s_bounds_the_wait(fleet, tmp_path)


def _max_waiting_refuses_at_once(fleet: Fleet, tmp_path: Path) -> None:
    gw = fleet.gateway(max_waiting=1, wait_s=120)
    asks = fleet.api.asks
    first: list[tuple[int, dict[str, str], bytes]] = []
    waiting = threading.Thread(target=lambda: first.append(_infer(gw.http, "held")))
    waiting.start()
    wait_until(lambda: fleet.api.asks == asks + 1, 60, "the first request's ask at the controller")
    status, headers, body = _infer(gw.http, "held")  # a second one while the load is held
    assert waiting.is_alive() and _loads(fleet.servers, "held") == 0  # refused at once, not after
    assert status == 503 and headers.get("retry-after") == "5", (status, body)
    assert json.loads(body)["error"] == (
        "1 requests already wait for models to load (cold_start.max_waiting is 1); retry later"
    )
    (tmp_path / "open-held").touch()
    waiting.join()
    assert first[0][0] == 200 and json.loads(first[0][2])["outputs"][0]["data"] == [3.0] * 4, first
    assert fleet.api.asks == asks + 1  # the refused request asked nothing


def _wait_s_bounds_the_wait(fleet: Fleet, tmp_path: Path) -> None:
    gw = fleet.gateway(wait_s=1)
    status, headers, body = _infer(gw.http, "slow")
    assert _loads(fleet.servers, "slow") == 0  # answered while the load is still held
    assert status == 503 and headers.get("retry-after") == "5", (status, body)
    assert json.loads(body)["error"] == "model slow is still loading; retry"
    (tmp_path / "open-slow").touch()
    wait_until(lambda: _loads(fleet.servers, "slow") == 1, 120, "slow loaded")
    wait_until(lambda: _infer(gw.http, "slow")[0] == 200, 60, "slow answered once loaded")
    assert _loads(fleet.servers, "slow") == 1
