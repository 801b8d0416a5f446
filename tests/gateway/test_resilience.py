"""Failures under load with real servers: kill, hang, eject, re-admit, spill over, drain.

No durations are asserted: each test waits, bounded, on state the gateway shows (admin, metrics).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from gateway.config import HealthConfig, RetryConfig
from skewserve.triton_process import TritonServer, TritonServerSpec
from tests.gateway.conftest import GatewayUnderTest, gateway_config, start_fleet, stop_fleet, wait_until
from tests.gateway.relay import TcpRelay
from tests.gateway.steady_load import check_infer_answer
from tests.gateway.test_hostile_health import BOOM_BODY, hostile_repo

X = np.random.default_rng(9).standard_normal((2, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def fragile_fleet(gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton):
    # The exported models, plus `slow` (50 ms a request) that keeps requests in flight on each server.
    repo = hostile_repo(gateway_repo, tmp_path_factory.mktemp("fragile_repo"))
    shutil.copytree(gateway_repo / "lt", repo / "lt")
    f = start_fleet(repo, {"us-east": 2, "eu-west": 1}, tmp_path_factory.mktemp("fragile"), prepared_triton)
    yield f
    stop_fleet(f)


class Load:
    """Client threads sending inferences until stopped; every failure is kept."""

    def __init__(self, http: str, grpc_address: str, model: str = "lt_nocache") -> None:
        self.ok = 0
        self.failures: list[str] = []
        self.regions: list[str] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._http, args=(http, model)),
            threading.Thread(target=self._grpc, args=(grpc_address, model)),
        ]

    def _http(self, address: str, model: str) -> None:
        body = json.dumps(
            {
                "inputs": [
                    {"name": "features", "shape": [2, 8], "datatype": "FP32", "data": X.ravel().tolist()}
                ]
            }
        ).encode()
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(f"http://{address}/v2/models/{model}/infer", data=body), timeout=10
                ) as r:
                    check_infer_answer(r.read(), rows=2)
                    self.regions.append(r.headers["x-skewserve-region"])
                    self.ok += 1
            except Exception as exc:
                self.failures.append(f"http: {exc!r}")

    def _grpc(self, address: str, model: str) -> None:
        client = grpcclient.InferenceServerClient(address)
        inp = grpcclient.InferInput("features", [2, 8], "FP32")
        inp.set_data_from_numpy(X)
        while not self.stop.is_set():
            try:
                answer = client.infer(model, [inp]).get_response()
                if not answer.outputs or any(o.shape[0] != 2 for o in answer.outputs):
                    raise ValueError(f"partial answer: {answer}")
                self.ok += 1
            except Exception as exc:
                self.failures.append(f"grpc: {exc!r}")

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def _kill(server: TritonServer) -> None:
    assert server.pid is not None
    os.killpg(server.pid, signal.SIGKILL)


def _restart_same_ports(server: TritonServer, prepared) -> TritonServer:
    server.stop()
    spec = TritonServerSpec(
        **{
            **server.spec.model_dump(),
            "http_port": server.http_port,
            "grpc_port": server.grpc_port,
            "metrics_port": server.metrics_port,
        }
    )
    fresh = TritonServer(spec, server.log_dir, prepared)
    deadline = time.monotonic() + 30
    while True:  # the killed process's ports may linger for a moment
        try:
            return fresh.start()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class ConcurrentLoad:
    """`clients` threads of one protocol sending the `slow` model until stopped; failures are kept."""

    def __init__(self, http: str, grpc_address: str, protocol: str, clients: int = 16) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        target = self._http if protocol == "http" else self._grpc
        address = http if protocol == "http" else grpc_address
        self.threads = [threading.Thread(target=target, args=(address,)) for _ in range(clients)]

    def _done(self, failure: str | None) -> None:
        with self.lock:
            if failure is None:
                self.ok += 1
            else:
                self.failures.append(failure)

    def _http(self, address: str) -> None:
        while not self.stop.is_set():
            try:
                # Longer than the default attempt bound (10 s): a hung server's requests are retried.
                req = urllib.request.Request(f"http://{address}/v2/models/slow/infer", data=BOOM_BODY)
                with urllib.request.urlopen(req, timeout=120) as r:
                    assert json.loads(r.read())["outputs"][0]["data"] == [1.0, 2.0, 3.0, 4.0]
                self._done(None)
            except Exception as exc:
                self._done(f"http: {exc!r}")

    def _grpc(self, address: str) -> None:
        client = grpcclient.InferenceServerClient(address)
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.array([[1.0, 2.0, 3.0, 4.0]], np.float32))
        while not self.stop.is_set():
            try:
                out = client.infer("slow", [inp], client_timeout=120).as_numpy("OUTPUT0")
                assert out.tolist() == [[1.0, 2.0, 3.0, 4.0]]
                self._done(None)
            except Exception as exc:
                self._done(f"grpc: {exc!r}")

    def __enter__(self) -> ConcurrentLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def _retries(gw: GatewayUnderTest) -> float:
    return sum(
        float(line.split()[-1])
        for line in gw.metrics().splitlines()
        if line.startswith("skewserve_gateway_retries_total{")
    )


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_server_killed_or_hung_under_load_costs_retries_not_failures(
    fragile_fleet, make_gateway, prepared_triton, fault: str, protocol: str
) -> None:
    # The default health and retry settings: what a deployment gets without tuning.
    gw = make_gateway(
        gateway_config(fragile_fleet, health=HealthConfig().model_dump(), retries=RetryConfig().model_dump())
    )
    victim = fragile_fleet["us-east"][0]
    name = victim.spec.name
    assert victim.pid is not None
    retries_before = _retries(gw)
    try:
        with ConcurrentLoad(gw.http, gw.grpc, protocol, clients=16) as load:
            wait_until(lambda: load.ok >= 32, timeout=60, what="the load to warm up")
            # The `slow` model (50 ms a request, one at a time) keeps requests queued on each server:
            # with two in flight on the victim, one is still there when the signal lands.
            wait_until(lambda: gw.server(name)["inflight"] >= 2, timeout=30, what="requests on the victim")
            os.killpg(victim.pid, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
            try:
                wait_until(
                    lambda: not gw.server(name)["available"] and gw.server(name)["inflight"] == 0,
                    timeout=60,
                    what="the victim out of rotation with none of its requests left waiting",
                )
                served = load.ok
                wait_until(lambda: load.ok >= served + 32, timeout=60, what="the load to go on")
            finally:
                if fault == "sigstop":
                    os.killpg(victim.pid, signal.SIGCONT)
        assert load.failures == [], load.failures[:5]
        assert _retries(gw) > retries_before
        assert gw.server(name)["failures"] >= 2
        if fault == "sigstop":  # only requests sent to the stopped server meet the attempt bound
            assert "no response within 10.000s" in gw.log_path.read_text()
    finally:
        # A fresh victim either way: the Python backend does not always survive SIGSTOP + SIGCONT.
        fragile_fleet["us-east"][0] = _restart_same_ports(victim, prepared_triton)
    wait_until(lambda: gw.server(name)["available"], timeout=60, what="re-admission of the victim")


@pytest.mark.slow
def test_spill_over_to_the_other_region_when_home_is_down(
    fragile_fleet, make_gateway, prepared_triton
) -> None:
    gw = make_gateway(gateway_config(fragile_fleet))
    home = fragile_fleet["us-east"]
    with Load(gw.http, gw.grpc) as load:
        wait_until(lambda: len(load.regions) >= 5, timeout=30, what="the load to warm up")
        for s in home:
            _kill(s)
        killed = len(load.regions)
        wait_until(
            lambda: load.regions[killed:].count("eu-west") >= 20, timeout=60, what="answers from eu-west"
        )
    assert load.failures == [], load.failures[:5]
    assert load.regions[-1] == "eu-west" and "us-east" in load.regions
    metrics = gw.metrics()
    assert 'skewserve_gateway_spillovers_total{from_region="us-east",to_region="eu-west"}' in metrics
    for i, s in enumerate(home):
        home[i] = _restart_same_ports(s, prepared_triton)
    wait_until(
        lambda: all(gw.server(s.spec.name)["available"] for s in home), timeout=20, what="home region back"
    )
    req = urllib.request.Request(
        f"http://{gw.http}/v2/models/lt_nocache/infer",
        data=json.dumps(
            {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8}]}
        ).encode(),
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["x-skewserve-region"] == "us-east"


def test_unloaded_model_gets_no_requests_and_pinned_region_without_it_is_503(
    gateway_repo, tmp_path, prepared_triton, make_gateway
) -> None:
    fleet = start_fleet(
        gateway_repo,
        {"us-east": 1, "eu-west": 1},
        tmp_path / "logs",
        prepared_triton,
        model_control_mode="explicit",
        load_models=("lt", "lt_nocache"),
    )
    try:
        gw = make_gateway(gateway_config(fleet))
        httpclient.InferenceServerClient(fleet["us-east"][0].http_address).unload_model("lt_nocache")
        wait_until(
            lambda: "lt_nocache" not in gw.server("us-east-0")["models"], what="health to see the unload"
        )
        client = httpclient.InferenceServerClient(gw.http)
        inp = httpclient.InferInput("features", [2, 8], "FP32")
        inp.set_data_from_numpy(X)
        for _ in range(5):
            client.infer("lt_nocache", [inp])  # all served by eu-west
        assert gw.server("eu-west-0")["requests"] >= 5 and gw.server("us-east-0")["requests"] == 0
        req = urllib.request.Request(
            f"http://{gw.http}/v2/models/lt_nocache/infer",
            headers={"x-skewserve-region": "us-east"},
            data=json.dumps(
                {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8}]}
            ).encode(),
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 503
        assert (
            json.loads(info.value.read())["error"]
            == "no server in region 'us-east' has model 'lt_nocache' ready"
        )
    finally:
        stop_fleet(fleet)


DRAIN_ORDER = ("serving-ready", "serving-not-ready", "refusing", "gone")


def _drain_state(gw) -> str:
    """One observation: readiness, then an inference (states only move forward between the two)."""
    try:
        with urllib.request.urlopen(f"http://{gw.http}/v2/health/ready", timeout=10) as r:
            ready = r.status == 200
    except urllib.error.HTTPError:
        ready = False
    except OSError:
        return "gone"
    body = json.dumps(
        {"inputs": [{"name": "features", "shape": [2, 8], "datatype": "FP32", "data": X.ravel().tolist()}]}
    ).encode()
    req = urllib.request.Request(f"http://{gw.http}/v2/models/lt_nocache/infer", data=body)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
            return "serving-ready" if ready else "serving-not-ready"
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read())["error"]
        assert exc.code == 503 and error == "gateway is shutting down; retry on another replica", error
        return "refusing"
    except OSError:
        return "gone"


def test_sigterm_drains_not_ready_first_then_exits(fleet, make_gateway) -> None:
    """After SIGTERM the gateway moves through its states in order, observed by polling, not timed:
    ready and serving -> not-ready but still serving (the grace) -> refusing new requests -> exit 0."""
    gw = make_gateway(gateway_config(fleet, drain={"grace_s": 3.0, "timeout_s": 5}))
    assert _drain_state(gw) == "serving-ready"
    gw.proc.send_signal(signal.SIGTERM)
    seen = ["serving-ready"]
    for _ in range(2000):  # bounded: the grace is 3 s, each observation takes milliseconds
        state = _drain_state(gw)
        if state != seen[-1]:
            seen.append(state)
        if state == "gone" or gw.proc.poll() is not None:
            break
        time.sleep(0.02)
    assert gw.proc.wait(30) == 0
    # Distinct states appear in drain order (never back), and the grace was observed as a state.
    assert [DRAIN_ORDER.index(s) for s in seen] == sorted(DRAIN_ORDER.index(s) for s in seen), seen
    assert "serving-not-ready" in seen, seen
    log = gw.log_path.read_text()
    assert log.index("draining: reporting not-ready") < log.index("gateway stopped")


def test_a_request_in_flight_when_draining_starts_is_answered_before_exit(fleet, make_gateway) -> None:
    """Drain finishes what it started: a request held upstream through not-ready and refusing is
    still answered in full, and only then does the gateway exit."""
    triton = fleet["us-east"][0]
    relay = TcpRelay(triton.http_address, hold=True)
    # Upstream bounds far above anything the test waits for: only the release ends the held request.
    cfg = gateway_config(
        fleet,
        drain={"grace_s": 0.5, "timeout_s": 120},
        retries={"attempt_timeout_s": 120, "default_timeout_s": 120},
    )
    cfg["regions"] = [
        {
            "name": "us-east",
            "servers": [{"name": triton.spec.name, "http": relay.address, "grpc": triton.grpc_address}],
        }
    ]
    gw = make_gateway(cfg)
    body = json.dumps(
        {"inputs": [{"name": "features", "shape": [2, 8], "datatype": "FP32", "data": X.ravel().tolist()}]}
    ).encode()
    answers: list[bytes] = []

    def held_request() -> None:
        req = urllib.request.Request(f"http://{gw.http}/v2/models/lt_nocache/infer", data=body)
        with urllib.request.urlopen(req, timeout=120) as r:
            answers.append(r.read())

    holder = threading.Thread(target=held_request)
    try:
        holder.start()
        # Held only once its bytes reached the relay (the gateway counts it in flight before it
        # connects upstream): from then on new connections pass, this one stays held.
        wait_until(lambda: b"/infer " in bytes(relay.sent), what="the held request to reach the relay")
        assert gw.admin()["inflight"] == 1
        relay.pass_new()
        gw.proc.send_signal(signal.SIGTERM)
        # Through not-ready (still serving new requests) to refusing them, the held one still upstream.
        seen = ["serving-ready"]
        for _ in range(2000):  # bounded: each observation takes milliseconds, the grace is 0.5 s
            if (state := _drain_state(gw)) != seen[-1]:
                seen.append(state)
            if state != "serving-not-ready" and state != "serving-ready":
                break
            time.sleep(0.02)
        assert seen[-1] == "refusing", seen
        assert gw.proc.poll() is None and holder.is_alive() and not answers
        relay.release()
        holder.join(60)
    finally:
        relay.close()
    assert len(answers) == 1
    check_infer_answer(answers[0], rows=2)
    assert gw.proc.wait(30) == 0
    assert "drain timeout" not in gw.log_path.read_text()
