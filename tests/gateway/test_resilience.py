"""Failures under load with real servers: kill, eject, re-admit, spill over, drain."""

from __future__ import annotations

import json
import os
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

from skewserve.triton_process import TritonServer, TritonServerSpec
from tests.gateway.conftest import gateway_config, start_fleet, stop_fleet, wait_until

X = np.random.default_rng(9).standard_normal((2, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def fragile_fleet(gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton):
    f = start_fleet(
        gateway_repo, {"us-east": 2, "eu-west": 1}, tmp_path_factory.mktemp("fragile"), prepared_triton
    )
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
                client.infer(model, [inp])
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


@pytest.mark.slow
def test_killed_server_under_load_fails_no_request_is_ejected_and_readmitted(
    fragile_fleet, make_gateway, prepared_triton
) -> None:
    gw = make_gateway(gateway_config(fragile_fleet))
    victim = fragile_fleet["us-east"][0]
    with Load(gw.http, gw.grpc) as load:
        time.sleep(1.0)
        before = load.ok
        _kill(victim)
        killed_at = time.monotonic()
        wait_until(
            lambda: not gw.server(victim.spec.name)["available"],
            timeout=5,
            what="the dead server to leave rotation",
        )
        out_after = time.monotonic() - killed_at
        time.sleep(1.0)
    assert load.failures == [], load.failures[:5]
    assert load.ok > before > 0
    assert out_after < 1.0, f"dead server still in rotation {out_after:.2f}s after the kill"
    state = gw.server(victim.spec.name)
    assert state["ejections"] >= 1 or not state["healthy"]

    fragile_fleet["us-east"][0] = _restart_same_ports(victim, prepared_triton)
    wait_until(
        lambda: gw.server(victim.spec.name)["available"], timeout=20, what="re-admission after restart"
    )


@pytest.mark.slow
def test_spill_over_to_the_other_region_when_home_is_down(
    fragile_fleet, make_gateway, prepared_triton
) -> None:
    gw = make_gateway(gateway_config(fragile_fleet))
    home = fragile_fleet["us-east"]
    with Load(gw.http, gw.grpc) as load:
        wait_until(lambda: "us-east" in load.regions, what="home-region traffic before the kill")
        for s in home:
            _kill(s)
        wait_until(lambda: "eu-west" in load.regions, timeout=30, what="traffic to spill over to eu-west")
        spilled = len(load.regions)
        wait_until(lambda: len(load.regions) >= spilled + 10, timeout=30, what="ten more answers")
    assert load.failures == [], load.failures[:5]
    assert set(load.regions[spilled:]) == {"eu-west"}  # once spilled, every answer from the other region
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
