"""Cold models on demand through the real gateway and the controller's demand API: the first
requests for a model no server holds cause exactly one load in the fleet and are then answered; a
model that cannot fit is a 503 with Retry-After and the reason; an unknown name is Triton's answer."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.placement import CopyBounds, PlacementConfig
from controller.runner import ControllerThread
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, start_servers, stop_servers
from tests.controller.conftest import controlled_server, controller_and_gateway
from tests.fixtures_models import write_affine_model
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway
from tests.waiting import wait_until

BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
).encode()


def _infer(http: str, model: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        f"http://{http}/v2/models/{model}/infer", BODY, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


@pytest.mark.slow
def test_cold_model_is_loaded_once_for_its_first_requests(
    tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    for m in ("a", "cold", "big"):
        write_affine_model(repo, m)
    (repo / "big" / "1" / "weights.bin").write_bytes(b"\0" * 2_000_000)  # larger than any server's room
    store = DiskStateStore(repo)
    footprint = int(store.version_bytes("a", 1) * 1.5)
    placement = PlacementConfig(
        server_capacity_bytes=int(footprint * 2.5),
        recent_use_guard_s=60,
        models={"cold": CopyBounds(min_copies=0), "big": CopyBounds(min_copies=0)},
    )
    cfg = ControllerConfig(interval_s=0.5, load_timeout_s=120, placement=placement)
    servers = [controlled_server(repo, n, tmp_path / "logs", prepared_triton) for n in ("s0", "s1")]
    try:
        start_servers(servers)
        with controller_and_gateway(servers, store, cfg, tmp_path / "gw", cold_start=True) as (thread, gw):
            _cold_model_once(servers, thread, gw)
    finally:
        stop_servers(servers)


def _cold_model_once(servers: list[TritonServer], thread: ControllerThread, gw: GatewayUnderTest) -> None:
    logs = lambda: "".join(s.log_text() for s in servers)  # noqa: E731
    assert "successfully loaded 'cold'" not in logs()

    answers: list[tuple[int, dict[str, str], bytes]] = []
    clients = [threading.Thread(target=lambda: answers.append(_infer(gw.http, "cold"))) for _ in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    assert [a[0] for a in answers] == [200] * 8, answers
    assert all(json.loads(a[2])["outputs"][0]["data"] == [3.0] * 4 for a in answers)
    assert logs().count("successfully loaded 'cold'") == 1  # one load in the whole fleet

    status, headers, body = _infer(gw.http, "big")
    assert status == 503 and headers.get("retry-after") == "5", (status, body)
    reason = json.loads(body)["error"]
    assert "model big cannot be loaded now: big needs" in reason and "more than a server's capacity" in reason
    assert "successfully loaded 'big'" not in logs()

    api = thread.demand_api
    assert api is not None
    asks = api.asks
    for _ in range(5):  # an invented name: Triton's own answer, and one ask of the controller
        status, _, body = _infer(gw.http, "no_such_model")
        assert status in (400, 404) and "unknown model" in json.loads(body)["error"], (status, body)
    assert api.asks == asks + 1


@pytest.mark.slow
def test_an_eviction_lets_the_requests_in_flight_finish(
    tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    """One server with room for one model: a cold model's first request evicts the model whose
    requests are in flight (LRU, no recent-use guard: the harshest policy), and every one of those
    requests is answered: Triton unloads a model only once the requests holding it are done."""
    repo = tmp_path / "repo"
    write_affine_model(repo, "slow", sleep_s=1.5)
    write_affine_model(repo, "cold")
    store = DiskStateStore(repo)
    placement = PlacementConfig(
        server_capacity_bytes=int(store.version_bytes("cold", 1) * 1.5 * 1.5),
        policy="lru",
        recent_use_guard_s=0,
        default=CopyBounds(min_copies=0),
    )
    cfg = ControllerConfig(interval_s=0.5, load_timeout_s=120, placement=placement)
    server = controlled_server(repo, "s0", tmp_path / "logs", prepared_triton)
    try:
        server.start()
        with controller_and_gateway([server], store, cfg, tmp_path / "gw", cold_start=True) as (_, gw):
            _slow_requests_outlive_their_eviction(server, gw)
    finally:
        server.stop()


def _slow_requests_outlive_their_eviction(server: TritonServer, gw: GatewayUnderTest) -> None:
    assert _infer(gw.http, "slow")[0] == 200  # loaded on demand
    answers: list[tuple[int, dict[str, str], bytes]] = []
    slow = [threading.Thread(target=lambda: answers.append(_infer(gw.http, "slow"))) for _ in range(4)]
    for t in slow:
        t.start()
    wait_until(lambda: gw.server("s0")["inflight"] >= 4, 30, "four slow requests in flight")
    status, _, body = _infer(gw.http, "cold")  # evicts `slow`, whose requests are in flight
    for t in slow:
        t.join()
    assert status == 200, body
    assert [a[0] for a in answers] == [200] * 4, answers
    assert all(json.loads(a[2])["outputs"][0]["data"] == [3.0] * 4 for a in answers)
    # (afterwards LRU may swap them again: both were asked for; what matters happened above)
    # Triton logs an unload once the requests holding the model are done, which may come after the
    # answer that caused it: wait for the line rather than read the log at once.
    wait_until(lambda: "successfully unloaded 'slow'" in server.log_text(), 60, "slow's unload is logged")
    assert "successfully loaded 'cold'" in server.log_text()


@pytest.mark.slow
def test_a_model_another_gateway_evicted_is_loaded_again_for_a_request_routed_to_it(
    tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    """Two gateways, one server with room for one model. Gateway B's request for `b` evicts `a`;
    gateway A, whose view still lists `a` on the server (its probes are far apart), routes a request
    for `a` there: the server answers it no longer has it, and the request, finding it held nowhere,
    waits for a cold start like a first request (one more ask) and is answered."""
    repo = tmp_path / "repo"
    for m in ("a", "b"):
        write_affine_model(repo, m)
    store = DiskStateStore(repo)
    placement = PlacementConfig(
        server_capacity_bytes=int(store.version_bytes("a", 1) * 1.5 * 1.5),
        policy="lru",
        recent_use_guard_s=0,
        default=CopyBounds(min_copies=0),
    )
    cfg = ControllerConfig(interval_s=0.5, load_timeout_s=120, placement=placement)
    server = controlled_server(repo, "s0", tmp_path / "logs", prepared_triton)
    try:
        server.start()
        with controller_and_gateway([server], store, cfg, tmp_path / "gw-b", cold_start=True) as (
            thread,
            gw_b,
        ):
            assert thread.demand_api is not None
            ask = {  # the controller as gateway B asks it (tests/controller/conftest.py)
                "controller_url": f"http://127.0.0.1:{thread.demand_api.port}",
                "token_file": str(tmp_path / "gw-b" / "controller-tokens" / "gateway-r"),
            }
            gw_a = launch_gateway(
                gateway_config(
                    {"r": [server]},
                    home="r",
                    cache={"models": []},
                    cold_start=ask,
                    health={"interval_s": 600, "timeout_s": 10},
                ),
                tmp_path / "gw-a",
            )
            try:
                assert _infer(gw_a.http, "a")[0] == 200  # loaded on demand, listed by A's own probe
                assert "a" in gw_a.server("s0")["models"]
                assert _infer(gw_b.http, "b")[0] == 200  # evicts `a` (one model's room)
                # Triton's unload returns before the model is torn down (its log line can follow b's answer)
                wait_until(
                    lambda: "successfully unloaded 'a'" in server.log_text(), 60, "a's unload is logged"
                )
                assert "a" in gw_a.server("s0")["models"]  # A's view is stale: no probe since
                api = thread.demand_api
                assert api is not None
                asks = api.asks
                status, _, body = _infer(gw_a.http, "a")
                assert status == 200, body
                assert json.loads(body)["outputs"][0]["data"] == [3.0] * 4
                assert api.asks == asks + 1  # held nowhere: a cold start, not a failure
                assert server.log_text().count("successfully loaded 'a'") == 2
            finally:
                gw_a.stop()
    finally:
        server.stop()


def test_a_request_waits_for_at_most_three_cold_starts_of_a_model_that_keeps_moving() -> None:
    """The bound of the path above (gateway/core.py COLD_START_ROUNDS): a model placement keeps
    moving away between its load and the request's next try is waited for three times, then the
    request fails with the router's own NoReadyServer, naming the model."""
    import asyncio

    from gateway.config import GatewayConfig
    from gateway.core import COLD_START_ROUNDS, Gateway
    from gateway.errors import NoReadyServer
    from gateway.fleet.cold_start import ColdStart

    waited: list[str] = []

    class PlacedThenMoved(ColdStart):
        """The controller places `a` each time it is asked; placement moves it before the next try."""

        def __init__(self) -> None:  # nothing to reach: this test drives only the gateway's loop
            pass

        def listed_anywhere(self, model: str) -> bool:
            return False

        async def wait_ready(self, model: str, deadline: float) -> bool:
            waited.append(model)
            return True

    # A real gateway whose one server once held `a` and holds it no more: every route is
    # NoReadyServer, and `a` is a known model (so the request does not go to any server at the end).
    gw = Gateway(
        GatewayConfig(
            home_region="r",
            regions=[{"name": "r", "servers": [{"name": "s", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}],
        )
    )
    (server,) = gw.router.servers()
    server.known_models = frozenset({"a"})
    gw.cold_start = PlacedThenMoved()
    with pytest.raises(NoReadyServer, match="model 'a'"):
        asyncio.run(gw.send("a", "", None, 1e9, lambda *_: None))  # type: ignore[arg-type,return-value]
    assert COLD_START_ROUNDS == 3 and waited == ["a"] * 3
