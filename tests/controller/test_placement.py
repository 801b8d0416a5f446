"""Placement by demand on real servers: copies follow a model's traffic through the gateway, then
follow a shift of popularity to another model, and settle; no server ever holds more than its
capacity, and no request fails."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.placement import PlacementConfig
from controller.reconcile import Controller, PassReport
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, start_servers, stop_servers
from tests.controller.conftest import KEY, as_controlled, controlled_server, loaded
from tests.fixtures_models import write_affine_model
from tests.gateway.conftest import gateway_config, launch_gateway

MODELS = ["m0", "m1", "m2", "m3"]
BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
).encode()


class ModelLoad:
    """Two client threads on one model through the gateway; every failure is kept."""

    def __init__(self, http: str, model: str) -> None:
        self.url = f"http://{http}/v2/models/{model}/infer"
        self.stop_event = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(2)]

    def _run(self) -> None:
        while not self.stop_event.is_set():
            req = urllib.request.Request(self.url, BODY, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    assert json.loads(r.read())["outputs"][0]["data"] == [3.0] * 4
                self.ok += 1
            except Exception as exc:  # every failure is recorded, none ignored
                self.failed.append(repr(exc))

    def __enter__(self) -> ModelLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join()


def _copies(servers: list[TritonServer], model: str) -> int:
    return sum(model in loaded(s) for s in servers)


@pytest.mark.slow
def test_placement_follows_demand_and_a_shift_within_capacity(
    tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    for m in MODELS:
        write_affine_model(repo, m)
    store = DiskStateStore(repo)
    footprint = int(store.version_bytes("m0", 1) * 1.5)
    placement = PlacementConfig(
        server_capacity_bytes=int(footprint * 2.5),  # room for two models per server
        target_rps_per_copy=1,  # two client threads make well over 3/s even on a loaded machine
        recent_use_guard_s=2,
    )
    cfg = ControllerConfig(interval_s=0.3, retry_after_s=0.2, load_timeout_s=120, placement=placement)
    servers = [controlled_server(repo, n, tmp_path / "logs", prepared_triton) for n in ("a", "b", "c")]
    gw = None
    try:
        start_servers(servers)
        controller = Controller(store, as_controlled(servers), KEY, cfg)
        over_capacity: list[str] = []

        def run_pass() -> PassReport:
            report = controller.reconcile_once()
            for s in servers:
                held = [m for m in loaded(s) if m in MODELS]
                if len(held) * footprint > placement.server_capacity_bytes:
                    over_capacity.append(f"{s.spec.name}: {held}")
            return report

        def passes_until(done: object, limit: int = 400) -> None:
            for _ in range(limit):
                run_pass()
                if done():  # type: ignore[operator]
                    return
                threading.Event().wait(cfg.interval_s)
            raise AssertionError("placement did not get there")

        run_pass()
        assert [_copies(servers, m) for m in MODELS] == [1, 1, 1, 1]  # each model's minimum, no more
        gw = launch_gateway(gateway_config({"r": servers}, home="r", cache={"models": []}), tmp_path / "gw")

        with ModelLoad(gw.http, "m0") as hot:
            passes_until(lambda: _copies(servers, "m0") == 3)
        # the shift: m0 goes quiet, m1 gets the traffic; m0 gives its copies up one at a time
        with ModelLoad(gw.http, "m1") as shifted:
            passes_until(lambda: _copies(servers, "m1") == 3 and _copies(servers, "m0") == 1)
            # settled: further passes change nothing while demand holds
            for _ in range(5):
                report = run_pass()
                assert report.loads == [] and report.evictions == [], (report.loads, report.evictions)
        assert [_copies(servers, m) for m in MODELS] == [1, 3, 1, 1]
        assert over_capacity == []
        assert hot.failed == [] and shifted.failed == [] and hot.ok > 0 and shifted.ok > 0
    finally:
        if gw is not None:
            gw.stop()
        stop_servers(servers)
