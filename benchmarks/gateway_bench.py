"""Gateway benchmark: direct Triton vs through the gateway, side by side in one run.

Prints:
1. hop cost: median added latency (HTTP binary and gRPC) at concurrency 1, throughput ratio at
   concurrency 8, and the gateway's CPU time per proxied request (its /proc CPU time over the
   run divided by requests served);
2. cache: gateway cache hit vs Triton's own response cache vs uncached direct, same request;
3. one slow server (5x its latency, via a delaying TCP proxy) among two: p99 with P2C-EWMA vs
   round-robin vs all-healthy.
Everything runs on loopback; runs are bounded in time. Usage: python benchmarks/gateway_bench.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc.aio  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402

from exporter.pipeline import export_artifact  # noqa: E402
from exporter.triton_config import ConfigOptions  # noqa: E402
from gateway.upstream_http import HttpPool  # noqa: E402
from loadtests.wire import binary_request  # noqa: E402
from skewserve.gateway_process import start_gateway_process  # noqa: E402
from skewserve.ports import free_port  # noqa: E402
from skewserve.triton_process import TritonServer, TritonServerSpec  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.launch import train  # noqa: E402
from training.synth import SynthSpec, write  # noqa: E402

N_FEATURES = 16
ROW = np.random.default_rng(0).standard_normal((1, N_FEATURES)).astype(np.float32)


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
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer", request_serializer=None, response_deserializer=None
        )
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


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q))


class Gateway:
    def __init__(
        self, servers: dict[str, list[tuple[str, str]]], workdir: Path, name: str, **overrides: object
    ) -> None:
        import yaml

        self.http_port, self.grpc_port = free_port(), free_port()
        cfg: dict = {
            "home_region": next(iter(servers)),
            "listen": {"http_port": self.http_port, "grpc_port": self.grpc_port, "ops_port": 0},
            "log_json": True,
            "cache": {"backend": "memory", "models": ["bench_gwcache"]},
            "health": {"interval_s": 0.5},
            "regions": [
                {
                    "name": r,
                    "servers": [{"name": f"{r}-{i}", "http": h, "grpc": g} for i, (h, g) in enumerate(s)],
                }
                for r, s in servers.items()
            ],
        } | overrides
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.process = start_gateway_process(path, workdir / f"{name}.log")
        self.proc = self.process.proc
        time.sleep(1.0)  # a couple of health rounds

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def stop(self) -> None:
        self.process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    args = parser.parse_args()
    secs = args.seconds
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write(SynthSpec(n_features=N_FEATURES, seed=0), work / "data")
        train(TrainConfig(data_dir=work / "data", out_dir=work / "art", epochs=3, progress=False))
        repo = work / "repo"
        for name, cache in (("bench", False), ("bench_gwcache", False), ("bench_tcache", True)):
            export_artifact(
                work / "art", repo, name, tensorrt="off", options=ConfigOptions(response_cache=cache)
            )
        logs = work / "logs"
        a = TritonServer(
            TritonServerSpec(repository=repo, name="a", cache_config=("local,size=16777216",)), logs
        ).start()
        b = TritonServer(TritonServerSpec(repository=repo, name="b"), logs).start()
        procs: list[subprocess.Popen] = []
        try:
            run_all(a, b, work, secs, procs)
        finally:
            for p in procs:
                p.kill()
            a.stop()
            b.stop()


def run_all(a: TritonServer, b: TritonServer, work: Path, secs: float, procs: list) -> None:
    gw = Gateway({"local": [(a.http_address, a.grpc_address)]}, work, "hop")
    try:
        print("\n## 1. Gateway hop (model `bench`, one row of 16 features; direct and gateway alternate)\n")
        print(
            "| protocol | concurrency | direct p50 ms | gateway p50 ms | added p50 ms | direct rps | gateway rps | ratio | gateway CPU us/req |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for protocol in ("http", "grpc"):
            for conc in (1, 8):
                d_addr = a.http_address if protocol == "http" else a.grpc_address
                g_addr = gw.http if protocol == "http" else gw.grpc
                direct = asyncio.run(drive(protocol, d_addr, "bench", conc, secs))
                cpu0 = cpu_seconds(gw.proc.pid)
                via = asyncio.run(drive(protocol, g_addr, "bench", conc, secs))
                cpu_us = (cpu_seconds(gw.proc.pid) - cpu0) / len(via) * 1e6
                d50, g50 = pct(direct, 50), pct(via, 50)
                d_rps, g_rps = len(direct) / secs, len(via) / secs
                print(
                    f"| {protocol} | {conc} | {d50:.3f} | {g50:.3f} | {g50 - d50:+.3f} | {d_rps:.0f} | {g_rps:.0f} | {g_rps / d_rps:.2f}x | {cpu_us:.0f} |",
                    flush=True,
                )

        print("\n## 2. Cache: the same request repeated, concurrency 1\n")
        print("| path | p50 ms | p99 ms | gateway CPU us/req |")
        print("|---|---:|---:|---:|")
        for label, protocol, addr, model, on_gw in (
            ("direct, uncached (HTTP)", "http", a.http_address, "bench", False),
            ("direct, Triton response cache (HTTP)", "http", a.http_address, "bench_tcache", False),
            ("gateway cache hit (HTTP)", "http", gw.http, "bench_gwcache", True),
            ("direct, uncached (gRPC)", "grpc", a.grpc_address, "bench", False),
            ("direct, Triton response cache (gRPC)", "grpc", a.grpc_address, "bench_tcache", False),
            ("gateway cache hit (gRPC)", "grpc", gw.grpc, "bench_gwcache", True),
        ):
            cpu0 = cpu_seconds(gw.proc.pid)
            lat = asyncio.run(drive(protocol, addr, model, 1, secs))
            cpu = f"{(cpu_seconds(gw.proc.pid) - cpu0) / len(lat) * 1e6:.0f}" if on_gw else "-"
            print(f"| {label} | {pct(lat, 50):.3f} | {pct(lat, 99):.3f} | {cpu} |", flush=True)
    finally:
        gw.stop()

    print("\n## 3. One slow server among two (gRPC, concurrency 4)\n")
    base = statistics.median(asyncio.run(drive("grpc", b.grpc_address, "bench", 1, 1.0)))
    delay = 4 * base  # the proxy adds 4x the server's own median: 5x its latency
    http_proxy, grpc_proxy = free_port(), free_port()
    for listen, target in ((http_proxy, b.http_port), (grpc_proxy, b.grpc_port)):
        procs.append(
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
    results = {}
    for label, servers, policy in (
        ("all healthy", healthy, "p2c_ewma"),
        ("one slow", slowed, "p2c_ewma"),
        ("one slow", slowed, "round_robin"),
    ):
        g = Gateway(servers, work, f"slow-{policy}-{len(results)}", balancing={"policy": policy})
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


if __name__ == "__main__":
    main()
