"""Hostile clients and failing servers against real Triton and gateway processes (issue 9).

A client's own deadline never costs a server its place; server errors do; ejection is capped per
region and panics into ejected servers rather than refusing; bad regions and versions are the
client's 400; sequences stick to one server; a cancelled hedged call leaves nothing running.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway.config import ConfigError, GatewayConfig, HealthConfig, ServerConfig, load_gateway_config
from gateway.errors import InvalidVersion
from gateway.fleet.balancer import RoundRobinBalancer
from gateway.fleet.dispatch import check_version
from gateway.fleet.health import OutlierDetector
from gateway.fleet.router import Region, RegionRouter, rendezvous
from gateway.upstream.server import UpstreamServer
from skewserve.ports import free_port
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, start_fleet, stop_fleet, wait_until

_MODEL_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
BOOM_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("boom: this model always fails")
"""
SLOW_PY = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({sleep_s})  # long enough that requests are always queued on each server
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""
# KServe v2 JSON for the INPUT0 models above, and for the exported `lt_nocache` (8 features).
BOOM_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()
LT_BODY = json.dumps(
    {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.3] * 8}]}
).encode()
DEFAULT_HEALTH = HealthConfig().model_dump()


def write_python_model(repo: Path, name: str, code: str) -> None:
    """A Python-backend model INPUT0 [4] -> OUTPUT0 [4], with both config profiles."""
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.py").write_text(code)
    config = _MODEL_CONFIG.format(name=name)
    (model_dir / "config.pbtxt").write_text(config)
    (model_dir / "configs").mkdir(exist_ok=True)
    (model_dir / "configs" / "local.pbtxt").write_text(config)


def hostile_repo(gateway_repo: Path, dest: Path, slow_s: float = 0.05) -> Path:
    """The exported `lt_nocache`, plus `boom` (always a server error) and `slow` (sleeps)."""
    shutil.copytree(gateway_repo / "lt_nocache", dest / "lt_nocache")
    write_python_model(dest, "boom", BOOM_PY)
    write_python_model(dest, "slow", SLOW_PY.format(sleep_s=slow_s))
    return dest


@pytest.fixture(scope="module")
def hostile_fleet(
    gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: Any
) -> Iterator[dict[str, list[TritonServer]]]:
    repo = hostile_repo(gateway_repo, tmp_path_factory.mktemp("hostile_repo"))
    f = start_fleet(repo, {"us-east": 2}, tmp_path_factory.mktemp("hostile_logs"), prepared_triton)
    yield f
    stop_fleet(f)


def _one_server(fleet: dict[str, list[TritonServer]]) -> dict[str, list[TritonServer]]:
    return {"us-east": fleet["us-east"][:1]}


def post(address: str, model: str, body: bytes, path: str = "", **headers: str) -> tuple[int, Any]:
    url = f"http://{address}/v2/models/{model}{path}/infer"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=30) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def counter(gw: GatewayUnderTest, name: str, model: str) -> float:
    prefix = f'{name}{{model="{model}"}} '
    lines = [line for line in gw.metrics().splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def raw_infer(
    address: str, model: str, sequence_id: int | None = None, version: str = ""
) -> tuple[pb.ModelInferResponse, dict[str, str]]:
    """One gRPC ModelInfer of `lt_nocache`-shaped input; returns the answer and trailing metadata."""
    req = pb.ModelInferRequest(model_name=model, model_version=version)
    tensor = req.inputs.add(name="features", datatype="FP32", shape=[1, 8])
    tensor.contents.fp32_contents.extend([0.3] * 8)
    if sequence_id is not None:
        req.parameters["sequence_id"].int64_param = sequence_id
    with grpc.insecure_channel(address) as channel:
        resp, call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(req, timeout=30)
        return resp, dict(call.trailing_metadata())


# -- item 2: a client's deadline is never a server fault ----------------------------------------


def test_impossible_client_deadlines_neither_eject_nor_poison_the_only_server(
    hostile_fleet, make_gateway, delayed
) -> None:
    """The only server answers inference a minute late (its probes at once): every request with a
    100 ms deadline runs out, by construction rather than by this machine's speed, and not one of
    those timeouts counts against the server."""
    server = hostile_fleet["us-east"][0]
    cfg = gateway_config({}, upstream_protocol="http", health=DEFAULT_HEALTH)
    cfg["regions"] = [
        {
            "name": "us-east",
            "servers": [
                {
                    "name": "late",
                    "http": delayed(server.http_port, 60.0, only_infer=True),
                    "grpc": delayed(server.grpc_port, 60.0),
                }
            ],
        }
    ]
    gw = make_gateway(cfg)
    before = gw.server("late")
    client = grpcclient.InferenceServerClient(gw.grpc)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(np.full((1, 8), 0.3, np.float32))
    timed_body = json.dumps({**json.loads(LT_BODY), "parameters": {"timeout": 100_000}}).encode()
    statuses: list[int] = []
    for _ in range(5):
        statuses.append(post(gw.http, "lt_nocache", LT_BODY, **{"x-skewserve-timeout-ms": "100"})[0])
        statuses.append(post(gw.http, "lt_nocache", timed_body)[0])  # KServe `timeout`, microseconds
    assert statuses == [504] * 10, statuses
    codes = []
    for _ in range(5):
        with pytest.raises(InferenceServerException) as info:
            client.infer("lt_nocache", [inp], client_timeout=0.1)  # the gRPC call deadline
        codes.append(info.value.status())
    assert codes == ["StatusCode.DEADLINE_EXCEEDED"] * 5
    after = gw.server("late")
    # Not one of those timeouts counted against the server, or entered its latency average.
    assert (after["ejections"], after["consecutive_failures"], after["failures"]) == (0, 0, 0)
    assert after["latency_samples"] == before["latency_samples"] and after["available"]


# -- item 7: server errors are failures, and their latency stays out of the score ---------------


def test_http_500_and_grpc_internal_count_toward_ejection_and_4xx_does_not(
    hostile_fleet, make_gateway
) -> None:
    health = {**DEFAULT_HEALTH, "base_ejection_s": 30.0}
    name = hostile_fleet["us-east"][0].spec.name
    gw = make_gateway(gateway_config(_one_server(hostile_fleet), health=health))
    assert post(gw.http, "lt_nocache", LT_BODY)[0] == 200
    before = gw.server(name)
    for _ in range(2):
        status, body = post(gw.http, "boom", BOOM_BODY)
        assert status == 500 and "boom: this model always fails" in body["error"]
    state = gw.server(name)
    assert (state["consecutive_failures"], state["failures"]) == (2, 2)
    assert state["latency_samples"] == before["latency_samples"]  # a fast error is not a fast server
    bad = json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [0.0] * 3}]}
    )
    assert post(gw.http, "lt_nocache", bad.encode())[0] == 400
    assert gw.server(name)["consecutive_failures"] == 2  # the client's mistake: neither way
    assert post(gw.http, "boom", BOOM_BODY)[0] == 500
    state = gw.server(name)
    assert state["ejections"] == 1 and not state["available"]
    assert state["ejection_history"][0]["reason"] == "server error: HTTP 500"

    gw2 = make_gateway(gateway_config(_one_server(hostile_fleet), health=health))
    client = grpcclient.InferenceServerClient(gw2.grpc)
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    for _ in range(3):
        with pytest.raises(InferenceServerException) as info:
            client.infer("boom", [inp])
        assert info.value.status() == "StatusCode.INTERNAL"
    state = gw2.server(name)
    assert state["ejections"] == 1 and state["ejection_history"][0]["reason"].startswith("server error:")


# -- item 2: max_ejection_percent and the panic threshold ---------------------------------------


def _eject_with_boom(gw: GatewayUnderTest, until: int) -> None:
    for _ in range(40):
        if sum(s["ejected"] for s in gw.admin()["servers"]) >= until:
            return
        assert post(gw.http, "boom", BOOM_BODY)[0] == 500
    raise AssertionError(f"fewer than {until} servers ejected after 40 server errors: {gw.admin()}")


def test_max_ejection_percent_keeps_half_the_region_in_rotation(hostile_fleet, make_gateway) -> None:
    gw = make_gateway(gateway_config(hostile_fleet, health={**DEFAULT_HEALTH, "base_ejection_s": 30.0}))
    _eject_with_boom(gw, 1)
    for _ in range(10):  # all on the one server still in rotation
        assert post(gw.http, "boom", BOOM_BODY)[0] == 500
    state = gw.admin()
    assert [s["ejected"] for s in state["servers"]].count(True) == 1  # 50% of two servers
    assert state["ejections_refused"] >= 1
    assert max(s["consecutive_failures"] for s in state["servers"]) >= 10


@pytest.mark.parametrize(("panic_percent", "expected"), [(50.0, 200), (0.0, 503)])
def test_panic_threshold_routes_to_ejected_servers_rather_than_none(
    hostile_fleet, make_gateway, panic_percent: float, expected: int
) -> None:
    health = {
        **DEFAULT_HEALTH,
        "base_ejection_s": 30.0,
        "max_ejection_percent": 100.0,
        "panic_threshold_percent": panic_percent,
    }
    gw = make_gateway(gateway_config(hostile_fleet, health=health))
    _eject_with_boom(gw, 2)  # a poison model took the whole region out
    assert not any(s["available"] for s in gw.admin()["servers"])
    status, answer = post(gw.http, "lt_nocache", LT_BODY)
    assert status == expected, answer
    if expected == 200:
        assert gw.admin()["panic_routes"] >= 1
    else:
        assert answer["error"] == "no server in any region has model 'lt_nocache' ready"


# -- item 13: unknown regions and malformed versions are the client's error ---------------------


def test_unknown_region_and_malformed_versions_are_refused_naming_the_value(
    hostile_fleet, make_gateway
) -> None:
    """A version that is not a whole number matches no Triton HTTP route (404, as Triton answers)
    and is INVALID_ARGUMENT on gRPC; "01" is version 1, as Triton reads it (issue 24)."""
    gw = make_gateway(gateway_config(hostile_fleet))
    status, body = post(gw.http, "lt_nocache", LT_BODY, **{"x-skewserve-region": "mars"})
    assert (status, body) == (400, {"error": "pinned region 'mars' does not exist; regions are ['us-east']"})
    for version in ("x", "-1", "1.0"):
        message = f"model version {version!r} is not a version: send a whole number (e.g. 1), or none for the latest"
        assert post(gw.http, "lt_nocache", LT_BODY, path=f"/versions/{version}") == (404, {"error": message})
        assert get(f"http://{gw.http}/v2/models/lt_nocache/versions/{version}") == (404, {"error": message})
        with pytest.raises(grpc.RpcError) as info:
            raw_infer(gw.grpc, "lt_nocache", version=version)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert post(gw.http, "lt_nocache", LT_BODY, path="/versions/01")[0] == 200
    client = grpcclient.InferenceServerClient(gw.grpc)
    with pytest.raises(InferenceServerException) as g_info:
        client.get_model_metadata("lt_nocache", "x")
    assert g_info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert post(gw.http, "lt_nocache", LT_BODY, path="/versions/1")[0] == 200


# -- item 13: sequences stick to one server and are never hedged ---------------------------------


def test_sequence_requests_stick_to_one_server_and_are_never_hedged(hostile_fleet, make_gateway) -> None:
    gw = make_gateway(gateway_config(hostile_fleet, hedging={"models": ["lt_nocache"], "min_delay_ms": 0}))
    # The contrast first: without a sequence id the model is hedged. Until a server has 8 latency
    # samples the hedge delay is min_delay_ms (0), so these are hedged whatever the latencies are.
    raw_infer(gw.grpc, "lt_nocache")
    hedges = counter(gw, "skewserve_gateway_hedges_total", "lt_nocache")
    assert hedges > 0
    servers_by_sequence: dict[int, set[str]] = {}
    for sequence in range(1, 13):
        for _ in range(4):
            _, trailing = raw_infer(gw.grpc, "lt_nocache", sequence_id=sequence)
            servers_by_sequence.setdefault(sequence, set()).add(trailing["x-skewserve-server"])
    assert all(len(s) == 1 for s in servers_by_sequence.values()), servers_by_sequence
    assert set().union(*servers_by_sequence.values()) == {"us-east-0", "us-east-1"}  # spread by id
    assert counter(gw, "skewserve_gateway_hedges_total", "lt_nocache") == hedges


def test_http_sequence_requests_stick_to_one_server_and_skip_the_cache(hostile_fleet, make_gateway) -> None:
    """The HTTP front reads `parameters.sequence_id` and pins the sequence as gRPC does; the model is
    cached here, and a sequence's answer depends on server-side state, so it is never cached."""
    cache = {"backend": "memory", "models": ["lt_nocache"], "ttl_s": 60}
    gw = make_gateway(gateway_config(hostile_fleet, cache=cache))
    servers_by_sequence: dict[int, set[str]] = {}
    for sequence in range(1, 13):
        body = json.dumps({**json.loads(LT_BODY), "parameters": {"sequence_id": sequence}}).encode()
        for _ in range(3):
            status, headers = post(gw.http, "lt_nocache", body)
            assert status == 200, headers
            assert "x-skewserve-cache" not in {k.lower() for k in headers}
            servers_by_sequence.setdefault(sequence, set()).add(headers["x-skewserve-server"])
    assert all(len(s) == 1 for s in servers_by_sequence.values()), servers_by_sequence
    assert set().union(*servers_by_sequence.values()) == {"us-east-0", "us-east-1"}  # spread by id
    status, headers = post(gw.http, "lt_nocache", LT_BODY)  # the contrast: without a sequence it is cached
    assert status == 200 and headers["x-skewserve-cache"] in {"hit", "miss"}


# -- items 8 and 13: per-attempt bound, and a cancelled hedged call --------------------------------


@pytest.fixture()
def delayed(hostile_fleet) -> Iterator[Any]:
    """Start loopback proxies delaying responses of a fleet server by a given number of seconds."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(target_port: int, delay_s: float, only_infer: bool = False) -> str:
        port = free_port()
        mode = ["--only-infer"] if only_infer else []
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "loadtests.delay_proxy",
                    str(port),
                    str(target_port),
                    str(delay_s),
                    *mode,
                ]
            )
        )
        wait_until(lambda: _listening(port), timeout=10, what="the delay proxy to listen")
        return f"127.0.0.1:{port}"

    yield start
    for p in procs:
        p.kill()
        p.wait(5)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_hung_attempt_is_retried_after_the_attempt_bound_and_counts_against_the_server(
    hostile_fleet, make_gateway, delayed
) -> None:
    fast, slow = hostile_fleet["us-east"]
    cfg = gateway_config(
        {},
        upstream_protocol="http",
        health=DEFAULT_HEALTH,
        balancing={"policy": "round_robin"},
        retries={"attempt_timeout_s": 0.5},
    )
    cfg["regions"] = [
        {
            "name": "us-east",
            "servers": [
                {"name": "fast", "http": fast.http_address, "grpc": fast.grpc_address},
                # Probes (HTTP) go direct; gRPC inference to this server hangs for a minute.
                {"name": "hung", "http": slow.http_address, "grpc": delayed(slow.grpc_port, 60.0)},
            ],
        }
    ]
    gw = make_gateway(cfg)
    for _ in range(4):  # no client deadline: only the gateway's own 0.5 s bound can save these
        resp, trailing = raw_infer(gw.grpc, "lt_nocache")
        assert trailing["x-skewserve-server"] == "fast" and resp.model_name == "lt_nocache"
    hung = gw.server("hung")
    assert hung["failures"] >= 1 and hung["requests"] >= 1
    assert counter(gw, "skewserve_gateway_retries_total", "lt_nocache") >= 1
    log = gw.log_path.read_text()
    assert "no response within 0.500s" in log


def test_a_cancelled_hedged_grpc_call_leaves_nothing_in_flight(hostile_fleet, make_gateway, delayed) -> None:
    """Both servers hang: the primary, then its hedge, are in flight when the client cancels;
    neither is left running."""
    cfg = gateway_config(
        {},
        upstream_protocol="http",
        hedging={"models": ["lt_nocache"], "min_delay_ms": 50},
        retries={"attempt_timeout_s": 120.0, "default_timeout_s": 120.0},
    )
    cfg["regions"] = [
        {
            "name": "us-east",
            "servers": [
                {"name": f"hung{i}", "http": s.http_address, "grpc": delayed(s.grpc_port, 60.0)}
                for i, s in enumerate(hostile_fleet["us-east"])
            ],
        }
    ]
    gw = make_gateway(cfg)
    req = pb.ModelInferRequest(model_name="lt_nocache")
    tensor = req.inputs.add(name="features", datatype="FP32", shape=[1, 8])
    tensor.contents.fp32_contents.extend([0.3] * 8)
    with grpc.insecure_channel(gw.grpc) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(req)
        wait_until(
            lambda: [gw.server(n)["inflight"] for n in ("hung0", "hung1")] == [1, 1],
            what="the primary and its hedge in flight",
        )
        assert counter(gw, "skewserve_gateway_hedges_total", "lt_nocache") == 1
        call.cancel()
        # The client gave up: both copies must go, not wait out the servers.
        wait_until(
            lambda: [gw.server(n)["inflight"] for n in ("hung0", "hung1")] == [0, 0],
            timeout=10,
            what="no attempt in flight",
        )
    assert gw.admin()["inflight"] == 0


def test_a_sequence_request_is_never_retried_on_another_server(hostile_fleet, make_gateway, delayed) -> None:
    fast, slow = hostile_fleet["us-east"]
    cfg = gateway_config({}, upstream_protocol="http", retries={"attempt_timeout_s": 0.5})
    cfg["regions"] = [
        {
            "name": "us-east",
            "servers": [
                {"name": "fast", "http": fast.http_address, "grpc": fast.grpc_address},
                {"name": "hung", "http": slow.http_address, "grpc": delayed(slow.grpc_port, 60.0)},
            ],
        }
    ]
    gw = make_gateway(cfg)
    outcomes: dict[int, str] = {}
    for sequence in range(1, 13):
        try:
            outcomes[sequence] = raw_infer(gw.grpc, "lt_nocache", sequence_id=sequence)[1][
                "x-skewserve-server"
            ]
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            assert "no response within 0.500s" in exc.details()
            outcomes[sequence] = "failed"
    # The sequences that hash to the hung server fail rather than move to a server without their
    # state (until the hung server is ejected), and nothing was retried.
    assert "failed" in outcomes.values() and "fast" in outcomes.values(), outcomes
    assert counter(gw, "skewserve_gateway_retries_total", "lt_nocache") == 0


# -- pieces, with no network ---------------------------------------------------------------------


def test_versions_must_be_whole_numbers_and_attempt_bounds_fit_the_default_deadline() -> None:
    for sent, routed in (("", ""), ("0", "0"), ("1", "1"), ("12", "12"), ("01", "1"), ("000", "0")):
        assert check_version(sent) == routed
    for bad in ("x", "-1", "1.0", " 1", "１", "9" * 19, "1" + "0" * 4400):
        with pytest.raises(InvalidVersion, match="is not a version"):
            check_version(bad)
    with pytest.raises(
        ConfigError, match=r"retries.attempt_timeout_s \(40.0\) exceeds retries.default_timeout_s"
    ):
        load_gateway_config(
            None,
            home_region="a",
            regions=[{"name": "a", "servers": [{"name": "a0", "http": "h:1", "grpc": "h:2"}]}],
            retries={"attempt_timeout_s": 40.0},
        )


def test_rendezvous_moves_only_the_sequences_of_a_server_that_leaves() -> None:
    servers = [
        UpstreamServer(ServerConfig(name=f"s{i}", http="127.0.0.1:1", grpc="127.0.0.1:2"), "a", 2.0, 1.0)
        for i in range(4)
    ]
    before = {key: rendezvous(str(key), servers).name for key in range(400)}
    assert set(before.values()) == {"s0", "s1", "s2", "s3"}
    after = {key: rendezvous(str(key), servers[:3]).name for key in range(400)}
    moved = {key for key in before if before[key] != after[key]}
    assert moved == {key for key, name in before.items() if name == "s3"}


def test_a_server_failing_fast_does_not_attract_traffic(
    tmp_path: Path, prepared_triton: Any, make_gateway
) -> None:
    """`flaky` raises on one server and works (a little slower) on the other: P2C must not prefer
    the fast failures. Ejection is kept out of the way to see the balancer alone."""
    failing, working = tmp_path / "failing", tmp_path / "working"
    write_python_model(failing, "flaky", BOOM_PY.replace('"boom:', '"flaky:'))
    write_python_model(working, "flaky", SLOW_PY.format(sleep_s=0.005))
    fleet = start_fleet(failing, {"us-east": 1}, tmp_path / "logs_failing", prepared_triton)
    fleet["us-east"] += start_fleet(working, {"us-west": 1}, tmp_path / "logs_working", prepared_triton)[
        "us-west"
    ]
    try:
        health = {**DEFAULT_HEALTH, "eject_after_failures": 1000}
        gw = make_gateway(gateway_config(fleet, health=health))
        statuses = [post(gw.http, "flaky", BOOM_BODY)[0] for _ in range(60)]
        by_server = {s["name"]: s["requests"] for s in gw.admin()["servers"]}
        failing_name, working_name = (s.spec.name for s in fleet["us-east"])
        assert statuses.count(500) == by_server[failing_name]
        # A few tries until the failures outweigh the working server's latency (its first, cold
        # answer included), then the working one only.
        assert by_server[failing_name] <= 10 and by_server[working_name] >= 50, json.dumps(gw.admin())
    finally:
        stop_fleet(fleet)


def test_recent_failures_weigh_on_the_p2c_score_and_fade() -> None:
    now = [100.0]
    server = UpstreamServer(
        ServerConfig(name="s", http="127.0.0.1:1", grpc="127.0.0.1:2"), "a", 2.0, 1.0, lambda: now[0]
    )
    server.latency.observe(0.002, now[0])
    detector = OutlierDetector(HealthConfig(eject_after_failures=1000))
    for _ in range(3):
        detector.failure(server, "server error: HTTP 500", now[0])
    assert server.score() == pytest.approx(0.002 * 8)
    now[0] += 10.0  # five EWMA time constants later, with no traffic: a chance again
    assert server.score() == pytest.approx(0.002)


def test_capped_ejection_spills_over_and_panic_routes_to_ejected_servers() -> None:
    now = [100.0]
    cfg = GatewayConfig(
        home_region="a",
        regions=[
            {"name": "a", "servers": [{"name": n, "http": "h:1", "grpc": "h:2"} for n in ("a0", "a1")]},
            {"name": "b", "servers": [{"name": "b0", "http": "h:3", "grpc": "h:4"}]},
        ],
    )
    servers = {}
    for region in cfg.regions:
        for sc in region.servers:
            s = UpstreamServer(sc, region.name, 2.0, 1.0, lambda: now[0])
            s.healthy, s.ready_models = True, {"m": {"1"}}
            servers[sc.name] = s
    a0, a1, b0 = servers["a0"], servers["a1"], servers["b0"]
    regions = [Region("a", [a0, a1]), Region("b", [b0])]
    router = RegionRouter(cfg, regions, {r.name: RoundRobinBalancer() for r in regions}, lambda: now[0])
    detector = OutlierDetector(cfg.health, servers=list(servers.values()))
    for _ in range(3):
        detector.failure(a0, "down", now[0])
        detector.failure(a1, "down", now[0])
    assert a0.ejected(now[0]) and not a1.ejected(now[0])  # 50% of region a at most
    assert detector.ejections_refused >= 1
    assert router.route("m", "").server is b0  # a1 fails in a row: spill over instead
    b0.healthy = False
    assert router.route("m", "").server is a1  # nothing better anywhere: the failing one
    a1.healthy = False
    # No available server anywhere; region a is below the panic threshold: its ejected but
    # healthy server first, rather than a 503.
    assert router.route("m", "").server is a0 and router.panic_routes == 1
