"""Does a Rust HTTP server with a Python interface cut what a request costs? (issue 39's native path)

The gateway's goals ask for a request's CPU near a bare uvloop + httptools pass-through's. One
candidate for a native data path is an existing Rust server that hands each request to Python:
granian, through its RSGI interface (the leaner of its two; ASGI adds a scope and messages). This
probe measures it beside the references, in alternating rounds (the order reversed every round;
each ratio from one round's figures), CPU of each server's process tree per request under wrk at
concurrency 8:

  fixed answer   the same bytes for every request (what a cache hit must at least pay):
                 a minimal uvloop + httptools protocol, granian RSGI, and the compiled gateway's
                 cache hit (model `bench_gwcache`);
  pass-through   each request sent to one Triton and its answer returned: the bare Python
                 pass-through (benchmarks/bare_proxy.py), granian RSGI with the same upstream leg,
                 and the compiled gateway (model `bench`).

granian is not a dependency of the project: install it beside, not into, the venv, and name the
folder: `.venv/bin/pip install --target /tmp/granian granian==2.8.9`, then
`.venv/bin/python benchmarks/native_server_probe.py --granian /tmp/granian [--rounds 6] [--seconds 3]
[--granian-args "--task-impl rust"]`.
Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXED = (
    b'{"model_name":"bench","model_version":"1","outputs":[{"name":"probabilities","datatype":"FP32",'
    b'"shape":[1,5],"data":[0.1,0.2,0.3,0.2,0.2]}]}'
)
_FIXED_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(FIXED),
    FIXED,
)


# --- the servers probed (run in their own processes) ----------------------------------------------


class _FixedProtocol(asyncio.Protocol):
    """The floor of any Python HTTP server: parse with httptools, answer fixed bytes, one write."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(_FIXED_RESPONSE)


async def _serve_fixed(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_FixedProtocol, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


async def fixed_app(scope: Any, proto: Any) -> None:
    """RSGI: the fixed answer."""
    await proto()
    proto.response_bytes(status=200, headers=[("content-type", "application/json")], body=FIXED)


_idle_upstreams: list[Any] = []


async def passthrough_app(scope: Any, proto: Any) -> None:
    """RSGI: the request to Triton over a kept-alive connection (bare_proxy's upstream leg), its
    answer back."""
    from benchmarks.bare_proxy import Upstream

    body = await proto()
    loop = asyncio.get_running_loop()
    if _idle_upstreams:
        upstream = _idle_upstreams.pop()
    else:
        host, _, port = os.environ["PROBE_UPSTREAM"].rpartition(":")
        upstream = (await loop.create_connection(Upstream, host, int(port)))[1]
    upstream.waiter = loop.create_future()
    upstream.transport.write(
        b"POST %s HTTP/1.1\r\nhost: upstream\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (scope.path.encode(), len(body), body)
    )
    answer = await upstream.waiter
    _idle_upstreams.append(upstream)
    proto.response_bytes(
        status=200,
        headers=[("content-type", "application/json")],
        body=answer.partition(b"\r\n\r\n")[2],
    )


# --- the probe ------------------------------------------------------------------------------------


def _server(
    cmd: list[str], port: int, env: dict[str, str], log: Path
) -> contextlib.AbstractContextManager[int]:
    from benchmarks.loadgen import listening_process

    return listening_process(cmd, [port], log, timeout_s=30, env=env, cwd=ROOT)


def _granian(target: str, port: int, extra: list[str]) -> list[str]:
    # One worker process, one Rust runtime thread, the same uvloop: the gateway's worker shape.
    return [
        sys.executable,
        *("-m", "granian", "--interface", "rsgi", "--workers", "1", "--runtime-threads", "1"),
        *("--runtime-mode", "st", "--loop", "uvloop", "--no-ws", "--http", "1", "--no-log"),
        *("--host", "127.0.0.1", "--port", str(port), *extra, f"benchmarks.native_server_probe:{target}"),
    ]


def run(granian_dir: Path, rounds: int, seconds: float, granian_args: list[str]) -> None:
    from benchmarks.gateway_bench import Bench, Gateway, prepare_repository, wrk_infer
    from benchmarks.loadgen import TreeCpu
    from skewserve.ports import free_port
    from skewserve.triton_process import TritonServer, TritonServerSpec

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        triton = TritonServer(TritonServerSpec(repository=prepare_repository(work), name="a"), work / "logs")
        triton.start()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(granian_dir), str(ROOT)]),
            "PROBE_UPSTREAM": triton.http_address,
        }
        ports = {name: free_port() for name in ("fixed", "granian fixed", "bare", "granian")}
        gateway: Gateway | None = None
        try:
            with contextlib.ExitStack() as stack:
                pids = {
                    "fixed": stack.enter_context(
                        _server(
                            [sys.executable, __file__, "--serve-fixed", str(ports["fixed"])],
                            ports["fixed"],
                            env,
                            work / "fixed.log",
                        )
                    ),
                    "granian fixed": stack.enter_context(
                        _server(
                            _granian("fixed_app", ports["granian fixed"], granian_args),
                            ports["granian fixed"],
                            env,
                            work / "granian-fixed.log",
                        )
                    ),
                    "bare": stack.enter_context(
                        _server(
                            [
                                sys.executable,
                                "benchmarks/bare_proxy.py",
                                str(ports["bare"]),
                                triton.http_address,
                            ],
                            ports["bare"],
                            env,
                            work / "bare.log",
                        )
                    ),
                    "granian": stack.enter_context(
                        _server(
                            _granian("passthrough_app", ports["granian"], granian_args),
                            ports["granian"],
                            env,
                            work / "granian.log",
                        )
                    ),
                }
                gateway = Gateway(Bench(triton, triton, work, seconds, []).local(), work, "compiled")
                # name -> (address, model, pid)
                paths = {
                    "fixed": (f"127.0.0.1:{ports['fixed']}", "bench", pids["fixed"]),
                    "granian fixed": (f"127.0.0.1:{ports['granian fixed']}", "bench", pids["granian fixed"]),
                    "gateway hit": (gateway.http, "bench_gwcache", gateway.proc.pid),
                    "bare": (f"127.0.0.1:{ports['bare']}", "bench", pids["bare"]),
                    "granian": (f"127.0.0.1:{ports['granian']}", "bench", pids["granian"]),
                    "gateway": (gateway.http, "bench", gateway.proc.pid),
                }
                figures: dict[str, list[float]] = {name: [] for name in paths}
                for r in range(rounds):
                    for name in list(paths) if r % 2 == 0 else list(reversed(paths)):
                        address, model, pid = paths[name]
                        wrk_infer(address, model, 8, 1)  # warm (and the hit path's entry filled)
                        cpu = TreeCpu(pid)
                        result = wrk_infer(address, model, 8, seconds)
                        figures[name].append(cpu.seconds() / max(1, result.requests) * 1e6)
                    print(f"round {r + 1} of {rounds}", flush=True)
                report(figures)
        finally:
            if gateway is not None:
                gateway.stop()
            triton.stop()


def report(figures: dict[str, list[float]]) -> None:
    def ratio(a: str, b: str) -> str:
        values = [x / y for x, y in zip(figures[a], figures[b], strict=True)]
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    print("\n| path | CPU µs per request at c8: median (range) | / its reference: median (range) |")
    print("|---|---:|---:|")
    for name, reference in (
        ("fixed", "fixed"),
        ("granian fixed", "fixed"),
        ("gateway hit", "fixed"),
        ("bare", "bare"),
        ("granian", "bare"),
        ("gateway", "bare"),
    ):
        values = figures[name]
        print(
            f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) | "
            f"{ratio(name, reference)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--granian", type=Path, help="folder granian was installed into (pip --target)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--granian-args", default="", help='more granian options, e.g. "--task-impl rust" (one string)'
    )
    parser.add_argument("--serve-fixed", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fixed is not None:
        import uvloop

        uvloop.run(_serve_fixed(args.serve_fixed))
        return
    if args.granian is None or not (args.granian / "granian").is_dir():
        parser.error(
            "--granian DIR: the folder granian is installed in, e.g. "
            "`.venv/bin/pip install --target /tmp/granian granian==2.8.9` then --granian /tmp/granian"
        )
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds must be at least 1 and --seconds above 0")
    run(args.granian.resolve(), args.rounds, args.seconds, args.granian_args.split())


if __name__ == "__main__":
    main()
