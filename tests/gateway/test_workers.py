"""Several gateway worker processes (listen.workers): one port per protocol, state shared through
Redis, a dead worker replaced, metrics summed, a drain that ends every worker."""

from __future__ import annotations

import http.client
import os
import re
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
from prometheus_client.parser import text_string_to_metric_families
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
    sent = 0
    for _ in range(200):  # fresh connections until the kernel has given each worker some
        status, _, _ = http_infer(gw)
        assert status == 200
        sent += 1
        if sent >= 12 and all(n > 0 for n in _served_by_worker(gw)):
            break
    for _ in range(8):
        assert grpc_infer(gw).model_name == "lt"
    served = _served_by_worker(gw)
    assert len(served) == 2 and all(n > 0 for n in served), served
    assert sum(served) == sent + 8
    # /metrics on the ops port is the sum over workers: every request counted once, in the
    # counter and in the latency histogram alike.
    samples = _lt_samples(gw.metrics())
    assert samples["skewserve_gateway_requests_total"] == sent + 8
    assert samples["skewserve_gateway_request_seconds_count"] == sent + 8
    assert samples['skewserve_gateway_request_seconds_bucket{le="+Inf"}'] == sent + 8
    assert "skewserve_gateway_requests_created" in samples  # one start time, not one per worker


def _served_by_worker(gw: GatewayUnderTest) -> list[int]:
    """Upstream requests each worker sent, from each worker's own view."""
    views = gw.admin()["workers"]
    assert all(v is not None for v in views)
    return [sum(s["requests"] for s in v["servers"]) for v in views]


def _lt_samples(text: str) -> dict[str, float]:
    """Series of model `lt`, summed over their other labels (protocol, region, code), by name (and `le`)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != "lt":
                continue
            # a start time is the earliest worker's, never one series per worker
            assert not (s.name.endswith("_created") and "worker" in s.labels), s
            key = f'{s.name}{{le="{s.labels["le"]}"}}' if "le" in s.labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def _stored(redis_url: str, namespace: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return sum(1 for _ in client.scan_iter(match=f"{namespace}:*", count=1000))
    finally:
        client.close()


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
                "redis_timeout_s": 5.0,  # a loaded CI machine must not turn a shared count local
            },
            limits={
                "per_client_rate_per_s": 0.001,
                "per_client_burst": 6,
                # the 12 connections are opened first and used afterwards: on a loaded machine the
                # first ones must not be closed as idle before their request is sent
                "header_read_timeout_s": 120,
                "keep_alive_timeout_s": 120,
            },
        )
    )
    assert len(workers_of(gw)) == 2
    by_worker = connections_by_worker(gw, per_worker=6)
    a, b = by_worker.values()
    answered: list[tuple[str, int, str | None]] = []  # (worker, status, cache state), in order
    for i in range(12):  # alternating workers, on connections each known to be held by one of them
        worker, conn = ("a", a[i // 2]) if i % 2 == 0 else ("b", b[i // 2])
        body, headers = binary_request(ROW, outputs=("probabilities",))
        conn.request("POST", "/v2/models/lt/infer", body, headers)
        resp = conn.getresponse()
        resp.read()
        answered.append((worker, resp.status, resp.getheader("x-skewserve-cache")))
        if i == 0:  # the entry is written by a background queue after the answer: wait for it
            wait_until(lambda: _stored(redis_url, f"workers{os.getpid()}") >= 1, 30, "the entry stored")
    for conns in by_worker.values():
        for conn in conns:
            conn.close()
    statuses = [status for _, status, _ in answered]
    # One budget of 6 for this client, not one per worker: both workers answer 3 then refuse 3.
    assert statuses == [200] * 6 + [429] * 6, answered
    # One miss (worker a), then hits from both workers: the entry is shared.
    ok = [(w, state) for w, status, state in answered if status == 200]
    assert ok[0] == ("a", "miss") and {state for _, state in ok[1:]} == {"hit"}
    assert {w for w, _ in ok[1:]} == {"a", "b"}


def connections_by_worker(
    gw: GatewayUnderTest, per_worker: int
) -> dict[int, list[http.client.HTTPConnection]]:
    """Open HTTP connections until each worker holds `per_worker` of them (the kernel spreads new
    connections over the workers' SO_REUSEPORT sockets); which worker holds one is read from the
    worker processes' own sockets, and keep-alive keeps it there for every request on it."""
    workers = workers_of(gw)
    held: dict[int, list[http.client.HTTPConnection]] = {w.pid: [] for w in workers}
    spare: list[http.client.HTTPConnection] = []
    for _ in range(20 * per_worker):
        if all(len(c) >= per_worker for c in held.values()):
            break
        conn = http.client.HTTPConnection(gw.host, gw.http_port, timeout=10)
        conn.connect()
        assert conn.sock is not None
        port = conn.sock.getsockname()[1]
        owner: list[int] = []

        def found(port: int = port, owner: list[int] = owner) -> bool:
            for w in workers:
                if any(c.raddr and c.raddr.port == port for c in w.net_connections("tcp")):
                    owner.append(w.pid)
                    return True
            return False

        wait_until(found, 10, f"a worker to accept the connection from port {port}")
        (held[owner[0]] if len(held[owner[0]]) < per_worker else spare).append(conn)
    for conn in spare:
        conn.close()
    assert all(len(c) >= per_worker for c in held.values()), {pid: len(c) for pid, c in held.items()}
    return held


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


def test_while_a_worker_is_dead_the_other_serves_and_restarts_back_off(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    """A worker that keeps dying early is started again after 0.5, 1, 2 s (doubling); meanwhile
    every HTTP and gRPC request is answered by the worker that is left."""
    gw = make_gateway(gateway_config(fleet, listen={"workers": 2}, cache={"backend": "none"}))
    served_while_dead = 0
    for _ in range(3):
        alive = _live_workers(gw)
        assert len(alive) == 2
        # always slot 0's process: the back-off is per slot
        victim = next(p for p in alive if p.cmdline()[p.cmdline().index("--worker") + 1].startswith("0:"))
        victim.kill()
        victim.wait(10)
        while len(_live_workers(gw)) == 1:  # until the replacement: bounded by the back-off (<= 2 s)
            assert http_infer(gw)[0] == 200
            assert grpc_infer(gw).model_name == "lt"
            served_while_dead += 1
        wait_until(lambda: all(v is not None for v in gw.admin()["workers"]), 60, "the replacement ready")
    assert served_while_dead > 0
    delays = [float(d) for d in re.findall(r"starting it again in ([\d.]+)s", gw.log_path.read_text())]
    assert delays == [0.5, 1.0, 2.0], delays


def _live_workers(gw: GatewayUnderTest) -> list[psutil.Process]:
    return [p for p in workers_of(gw) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


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


def test_the_supervisors_ops_listener_closes_half_sent_heads(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    """Issue 23, item 8: with listen.workers > 1 the ops port is the supervisor's; a client that
    never finishes its request headers is cut off after limits.header_read_timeout_s there too."""
    import socket

    gw = make_gateway(
        gateway_config(
            fleet, listen={"workers": 2}, cache={"backend": "none"}, limits={"header_read_timeout_s": 1}
        )
    )
    host, port = gw.ops.rsplit(":", 1)
    heads = [socket.create_connection((host, int(port)), timeout=30) for _ in range(20)]
    try:
        for s in heads:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHo")

        def closed(s: socket.socket) -> bool:
            s.settimeout(0.05)
            try:
                return s.recv(1024) == b""
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True

        wait_until(lambda: all(closed(s) for s in heads), 30, "the half-sent heads to be closed")
    finally:
        for s in heads:
            s.close()
    assert "skewserve_gateway_requests_total" in gw.metrics()  # whole requests are still served
