"""Issue 39's goals in alternating rounds: each ratio per round, then its median and range.

`gateway_bench.py --only hop` measures each path once, one after another; on a shared machine its
ratios moved by up to a third between two runs of the same day. Here
every path the goals compare is measured once per round, in an order reversed every round, and a
round's ratios use only that round's figures, taken seconds apart. The median over rounds is what a
goal is read against; the range shows how far one round alone could mislead.

Paths: the gateway in both builds (compiled, pure), HAProxy 2.8 pass-through (HTTP/1.1 and h2), the
bare Python pass-through (uvloop + httptools), direct Triton (for the added medians). `--against
NAME=DIR` adds the gateway of another checkout (its sources and compiled extensions, which its own
`make setup` built, run by this checkout's Python and libraries) to every round: how a change is
measured against the code before it. `--fleet N` has every gateway list the one Triton N times, in
three regions (home first), so routing sees a fleet of N servers holding every model (health probes
every 5 s instead of 0.5 s, so N servers' probes stay a small share of the CPU); the references keep
their one upstream.

Ratios (issue 39): HTTP CPU per request / bare Python (<= 2); HTTP throughput at c8 / HAProxy
(>= 0.85); HTTP added median at c1 / HAProxy (<= 2); gRPC CPU per call / HAProxy h2 (<= 2.5); gRPC
throughput at c8 / HAProxy h2 (>= 0.8); gRPC added median at c1 / HAProxy h2 (<= 2); HTTP cache hit
CPU at c8 / bare Python per request (<= 1). CPU: the proxy's whole process tree over the requests it
served. Printed, never asserted.

Usage: python benchmarks/gateway_goals.py [--rounds 5] [--seconds 2] [--against NAME=DIR ...] [--fleet N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gateway_bench import (  # noqa: E402
    Bench,
    Gateway,
    bare_python_proxy,
    floored_ratio,
    haproxy_binary,
    load,
    measured_load,
    median_c1_ms,
    prepare_repository,
    print_log_tails,
)
from benchmarks.loadgen import haproxy_reference  # noqa: E402
from skewserve.ports import free_port  # noqa: E402
from skewserve.triton_process import TritonServer, TritonServerSpec  # noqa: E402

MODEL, CACHED_MODEL = "bench", "bench_gwcache"
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Measured:
    """One thing to measure: a gateway or a reference, by protocol."""

    name: str
    http: str | None  # address, or None when it does not carry HTTP
    grpc: str | None
    pid: int
    gateway: Gateway | None = None  # its own view is checked before each of its measurements


@dataclass
class Figures:
    """One path's figures in one round (None where the path does not carry that protocol)."""

    http_rps: float | None = None
    http_cpu: float | None = None
    grpc_rps: float | None = None
    grpc_cpu: float | None = None
    hit_cpu: float | None = None
    http_p50: float | None = None
    grpc_p50: float | None = None


GOALS: list[tuple[str, str, Callable[[Figures, dict[str, Figures]], float]]] = [
    ("HTTP CPU per request / bare Python", "<= 2", lambda g, r: _div(g.http_cpu, r["bare"].http_cpu)),
    ("HTTP throughput at c8 / HAProxy", ">= 0.85", lambda g, r: _div(g.http_rps, r["haproxy"].http_rps)),
    (
        "HTTP added median at c1 / HAProxy",
        "<= 2",
        lambda g, r: _added(g.http_p50, r["haproxy"].http_p50, r["direct"].http_p50),
    ),
    ("gRPC CPU per call / HAProxy h2", "<= 2.5", lambda g, r: _div(g.grpc_cpu, r["haproxy"].grpc_cpu)),
    ("gRPC throughput at c8 / HAProxy h2", ">= 0.8", lambda g, r: _div(g.grpc_rps, r["haproxy"].grpc_rps)),
    (
        "gRPC added median at c1 / HAProxy h2",
        "<= 2",
        lambda g, r: _added(g.grpc_p50, r["haproxy"].grpc_p50, r["direct"].grpc_p50),
    ),
    (
        "HTTP cache hit CPU at c8 / bare Python per request",
        "<= 1",
        lambda g, r: _div(g.hit_cpu, r["bare"].http_cpu),
    ),
]


def _div(a: float | None, b: float | None) -> float:
    assert a is not None and b is not None
    return a / b


def _added(via: float | None, reference: float | None, direct: float | None) -> float:
    assert via is not None and reference is not None and direct is not None
    return floored_ratio(via - direct, reference - direct)


def measure_round(paths: list[Measured], secs: float, reverse: bool) -> dict[str, Figures]:
    """Every path once at c8 (HTTP, gRPC, the gateways' cache hit) and at c1, in one order."""
    order = paths[::-1] if reverse else paths
    out = {p.name: Figures() for p in paths}

    def ready(p: Measured) -> None:
        if p.gateway is not None:
            p.gateway.wait_available()

    for protocol in ("http", "grpc"):
        for p in order:
            address = p.http if protocol == "http" else p.grpc
            if address is None or p.name == "direct":
                continue
            ready(p)
            load(protocol, address, MODEL, 8, min(0.5, secs))  # connections open, the machine warm
            result, cpu = measured_load(protocol, address, MODEL, 8, secs, p.pid)
            setattr(out[p.name], f"{protocol}_rps", result.rps)
            setattr(out[p.name], f"{protocol}_cpu", cpu)
    for p in order:
        if p.gateway is not None:
            assert p.http is not None
            ready(p)
            load("http", p.http, CACHED_MODEL, 8, min(0.5, secs))  # fills the entry, then hits
            _, out[p.name].hit_cpu = measured_load("http", p.http, CACHED_MODEL, 8, secs, p.pid)
    for protocol in ("http", "grpc"):
        for p in order:
            address = p.http if protocol == "http" else p.grpc
            if address is None or p.name == "bare":  # no goal reads the bare pass-through's latency
                continue
            ready(p)
            setattr(out[p.name], f"{protocol}_p50", median_c1_ms(protocol, address, MODEL, secs))
    return out


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


PAIRED = (
    ("HTTP CPU per request at c8", "http_cpu"),
    ("HTTP requests/s at c8", "http_rps"),
    ("gRPC CPU per call at c8", "grpc_cpu"),
    ("gRPC calls/s at c8", "grpc_rps"),
    ("HTTP cache hit CPU at c8", "hit_cpu"),
)


def report_against(rounds: list[dict[str, Figures]], others: list[str]) -> None:
    """This checkout's compiled gateway against each other checkout's, round by round (a pair is
    measured seconds apart, so the machine's drift between rounds cancels)."""
    for other in others:
        print(
            f"\nThis checkout's compiled build against `{other}`, per round: median (range), rounds lower\n"
        )
        print(f"| figure | compiled / {other} | rounds where compiled is lower |")
        print("|---|---:|---:|")
        for name, field in PAIRED:
            pairs = [(getattr(r["compiled"], field), getattr(r[other], field)) for r in rounds]
            ratios = [a / b for a, b in pairs]
            lower = sum(a < b for a, b in pairs)
            print(f"| {name} | {_median_range(ratios)} | {lower} of {len(pairs)} |")


def report(rounds: list[dict[str, Figures]], gateways: list[str]) -> None:
    print("\n| goal (issue 39) | " + " | ".join(gateways) + " | goal |")
    print("|---|" + "---:|" * len(gateways) + "---:|")
    for name, goal, ratio in GOALS:
        cells = [_median_range([ratio(r[g], r) for r in rounds]) for g in gateways]
        print(f"| {name} | " + " | ".join(cells) + f" | {goal} |")
    print("\nMedian over rounds, (lowest-highest round). Each path's own figures, medians over rounds:\n")
    print(
        "| path | HTTP rps c8 | HTTP CPU µs/req | gRPC rps c8 | gRPC CPU µs/call | hit CPU µs | HTTP p50 ms | gRPC p50 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fields = ("http_rps", "http_cpu", "grpc_rps", "grpc_cpu", "hit_cpu", "http_p50", "grpc_p50")
    for path in rounds[0]:
        cells = []
        for field in fields:
            values = [getattr(r[path], field) for r in rounds if getattr(r[path], field) is not None]
            digits = 3 if field.endswith("p50") else 0
            cells.append(f"{statistics.median(values):.{digits}f}" if values else "")
        print(f"| {path} | " + " | ".join(cells) + " |")


def fleet_of(bench: Bench, size: int) -> dict[str, list[tuple[str, str]]]:
    """The one Triton listed `size` times over three regions (the home region first), or once."""
    if size <= 1:
        return bench.local()
    one = (bench.a.http_address, bench.a.grpc_address)
    return {name: [one] * (size // 3 + (i < size % 3)) for i, name in enumerate(("local", "r1", "r2"))}


@contextlib.contextmanager
def gateways(bench: Bench, against: dict[str, Path], fleet: int = 1) -> Iterator[list[Gateway]]:
    """This checkout's gateway in both builds, then each other checkout's, each started from its own
    tree: `python -m gateway` imports the gateway of its working directory."""
    started: list[Gateway] = []
    servers = fleet_of(bench, fleet)
    overrides: dict[str, object] = {"health": {"interval_s": 5.0}} if fleet > 1 else {}
    try:
        for name, tree, build in [
            ("compiled", ROOT, "compiled"),
            ("pure", ROOT, "pure"),
            *((name, tree, "compiled") for name, tree in against.items()),
        ]:
            with contextlib.chdir(tree):
                started.append(Gateway(servers, bench.work, name, build=build, **overrides))
        yield started
    finally:
        for gw in started:
            gw.stop()


def run(bench: Bench, rounds: int, against: dict[str, Path], fleet: int = 1) -> None:
    a = bench.a
    ports = (free_port(), free_port())
    with (
        haproxy_reference(haproxy_binary(), a.http_address, a.grpc_address, bench.work, ports) as ha,
        bare_python_proxy(a.http_address) as (bare_address, bare_pid),
        gateways(bench, against, fleet) as gws,
    ):
        names = ["compiled", "pure", *against]
        paths = [
            *(Measured(n, g.http, g.grpc, g.proc.pid, g) for n, g in zip(names, gws, strict=True)),
            Measured("haproxy", ha.http, ha.grpc, ha.pid),
            Measured("bare", bare_address, None, bare_pid),
            Measured("direct", a.http_address, a.grpc_address, 0),
        ]
        results = []
        for r in range(rounds):
            started = time.monotonic()
            results.append(measure_round(paths, bench.secs, reverse=r % 2 == 1))
            print(f"round {r + 1} of {rounds}: {time.monotonic() - started:.0f} s", flush=True)
        report(results, names)
        report_against(results, list(against))


def parse_against(text: str) -> tuple[str, Path]:
    name, sep, tree = text.partition("=")
    path = Path(tree).resolve()
    if not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise argparse.ArgumentTypeError(
            f"--against takes NAME=DIR, NAME of letters, digits, - and _; got {text!r}"
        )
    if not (path / "gateway" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"--against {text!r}: {path} is not a checkout with a gateway/")
    if not (path / "gateway" / "compiled.json").is_file():
        raise argparse.ArgumentTypeError(
            f"--against {text!r}: {path} has no compiled gateway build: run `make setup` there first"
        )
    if path == ROOT:
        raise argparse.ArgumentTypeError(f"--against {text!r}: that is this checkout, measured already")
    if name in {"compiled", "pure", "haproxy", "bare", "direct"}:
        raise argparse.ArgumentTypeError(
            f"--against: {name!r} names a path of this benchmark; choose another"
        )
    return name, path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds (order reversed every round)")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per path and figure")
    parser.add_argument("--against", type=parse_against, action="append", default=[], metavar="NAME=DIR")
    parser.add_argument(
        "--fleet", type=int, default=1, help="servers the gateways route over (one Triton, listed N times)"
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.seconds <= 0 or args.fleet < 1:
        parser.error("--rounds and --fleet must be at least 1 and --seconds above 0")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; {args.rounds} rounds of {args.seconds:g} s per figure; "
        f"gateways route over {args.fleet} server(s)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = prepare_repository(work)
        a = TritonServer(TritonServerSpec(repository=repo, name="a"), work / "logs").start()
        bench = Bench(a, a, work, args.seconds, [])
        try:
            run(bench, args.rounds, dict(args.against), args.fleet)
        except BaseException:
            print_log_tails(work)
            raise
        finally:
            a.stop()


if __name__ == "__main__":
    main()
