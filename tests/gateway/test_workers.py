"""Several gateway worker processes (listen.workers): one port per protocol, state shared through
Redis, a dead worker replaced, metrics summed, a drain that ends every worker."""

from __future__ import annotations

import http.client
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import psutil
import yaml
from tritonclient.grpc import service_pb2 as pb

from loadtests.wire import binary_request
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, wait_until

ROW = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)


def http_infer(gw: GatewayUnderTest, model: str = "lt") -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection (so the kernel picks a worker for each)."""
    body, headers = binary_request(ROW, outputs=("probabilities",))
    conn = http.client.HTTPConnection(gw.host, gw.http_port, timeout=10)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body, headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def grpc_infer(gw: GatewayUnderTest, model: str = "lt") -> pb.ModelInferResponse:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="features", datatype="FP32", shape=[1, 8])
    req.raw_input_contents.append(ROW.tobytes())
    with grpc.insecure_channel(f"{gw.host}:{gw.grpc_port}") as ch:
        call = ch.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        return call(req, timeout=10)


def workers_of(gw: GatewayUnderTest) -> list[psutil.Process]:
    return [p for p in psutil.Process(gw.proc.pid).children() if any(a == "--worker" for a in p.cmdline())]


def test_two_workers_serve_both_protocols_and_sum_their_metrics(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, listen={"workers": 2}, cache={"backend": "none"}))
    assert len(workers_of(gw)) == 2
    for _ in range(12):
        status, _, _ = http_infer(gw)
        assert status == 200
    for _ in range(8):
        assert grpc_infer(gw).model_name == "lt"
    views = gw.admin()["workers"]
    assert len(views) == 2 and all(v is not None for v in views)
    served = [sum(s["requests"] for s in v["servers"]) for v in views]
    assert sum(served) >= 20
    # /metrics on the ops port is the sum over workers: every request counted once.
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in gw.metrics().splitlines()
        if line.startswith("skewserve_gateway_requests_total{") and 'model="lt"' in line
    )
    assert total == 20


def test_cache_entries_and_rate_limits_are_shared_across_workers(
    fleet: dict[str, list[TritonServer]],
    make_gateway: Callable[..., GatewayUnderTest],
    redis_url: str,
) -> None:
    gw = make_gateway(
        gateway_config(
            fleet,
            listen={"workers": 2},
            cache={
                "backend": "redis",
                "redis_url": redis_url,
                "namespace": f"workers{os.getpid()}",
                "hmac_secret": secrets.token_hex(32),
                "models": ["lt"],
            },
            limits={"per_client_rate_per_s": 0.001, "per_client_burst": 6},
        )
    )
    assert len(workers_of(gw)) == 2
    states = []
    statuses = []
    for _ in range(12):  # fresh connections: the kernel spreads them over both workers
        status, headers, _ = http_infer(gw)
        statuses.append(status)
        states.append(headers.get("x-skewserve-cache"))
    # One budget of 6 for this client, not one per worker.
    assert statuses.count(200) == 6 and statuses.count(429) == 6
    # One miss, then hits, whichever worker answered.
    ok_states = [s for s, code in zip(states, statuses, strict=True) if code == 200]
    assert ok_states[0] == "miss" and set(ok_states[1:]) == {"hit"}


def test_rate_limits_with_per_worker_buckets_are_refused_at_start(tmp_path: Path) -> None:
    cfg = {
        "home_region": "a",
        "listen": {"workers": 2},
        "limits": {"per_client_rate_per_s": 5},
        "regions": [{"name": "a", "servers": [{"name": "s", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}],
    }
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "listen.workers" in done.stderr and "cache.backend: redis" in done.stderr


def test_a_killed_worker_is_replaced_and_sigterm_ends_all(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, listen={"workers": 2}, cache={"backend": "none"}))
    victim = workers_of(gw)[0]
    victim.kill()
    victim.wait(10)
    wait_until(
        lambda: (
            len([p for p in workers_of(gw) if p.status() != psutil.STATUS_ZOMBIE]) == 2
            and all(v is not None for v in gw.admin()["workers"])
        ),
        timeout=60,
        what="a replacement worker",
    )
    for _ in range(10):
        assert http_infer(gw)[0] == 200
        assert grpc_infer(gw).model_name == "lt"
    pids = [p.pid for p in workers_of(gw)]
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(30) == 0
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_a_killed_supervisor_takes_haproxy_and_its_workers_along(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, listen={"workers": 2}, cache={"backend": "none"}))
    children = psutil.Process(gw.proc.pid).children()
    assert len(children) == 3  # two workers and haproxy
    gw.proc.kill()
    gw.proc.wait(10)
    wait_until(
        lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
        timeout=30,
        what="workers and haproxy to exit with their supervisor",
    )


def test_gauges_keep_each_workers_view(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, listen={"workers": 2}, cache={"backend": "none"}))
    lines = [ln for ln in gw.metrics().splitlines() if ln.startswith("skewserve_gateway_upstream_available{")]
    assert lines and all('worker="' in ln for ln in lines)
    # One series per server and worker, each 0 or 1 (never a sum across workers).
    assert {float(ln.rsplit(" ", 1)[1]) for ln in lines} <= {0.0, 1.0}
    assert len({ln.split('worker="')[1][0] for ln in lines}) == 2
