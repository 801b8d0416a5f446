"""Routing's per-request cost as the fleet grows, in-process, against the fleet of one server a region.

What a cache-enabled HTTP request asks routing (gateway/pipeline/cached.py, gateway/core.py): the
highest version ready anywhere (`latest_version`), the model's metrics label twice (whether a
server has held it: `model_label`), and a server (`route`). Before the model index
(gateway/fleet/model_index.py) each of these walked every server of every region per request; with
it they read dicts rebuilt once per fleet change. The reference is the same build on a fleet of one
server per region, measured in the same run: a ratio near 1 at 600 servers means a request's
routing does not grow with the fleet. `--against DIR` measures another checkout's build (for
example the commit before the index, compiled) in the same rounds, alternating with this one.

Two fleet shapes, three regions each: every server holds every model (the worst case for the index:
a route still filters all of its region's servers), and placed models (each model on 3 servers of a
region, as the controller's placement spreads a large catalogue). Regions are ordered by their
servers' measured probe round-trip times (the default: no `rtt_ms`). The servers are real
`UpstreamServer` objects in a real `RegionRouter`; no request is sent, only routing state is read.

Usage: python benchmarks/fleet_routing_bench.py [--sizes 1,10,50,200] [--rounds R] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REGIONS = 3
MODELS = 40
PLACED_ON = 3  # servers per region holding each model, in the placed shape


def fleet(per_region: int, placed: bool) -> Any:
    from gateway.config import GatewayConfig
    from gateway.core import Gateway

    cfg = GatewayConfig(
        home_region="r0",
        regions=[
            {
                "name": f"r{r}",
                "servers": [
                    {"name": f"r{r}s{i}", "http": f"127.0.0.1:{1000 + i}", "grpc": f"127.0.0.1:{2000 + i}"}
                    for i in range(per_region)
                ],
            }
            for r in range(REGIONS)
        ],
    )
    gw = Gateway(cfg, clock=lambda: 0.0)
    for region in gw.router.regions.values():
        for i, server in enumerate(region.servers):
            held = [m for m in range(MODELS) if not placed or (m - i) % per_region < PLACED_ON]
            server.healthy = True
            server.probe_rtt.observe(0.001 * (1 + r_index(region.name)) + 0.0001 * (i % 7), 0.0)
            server.ready_models = {f"m{m}": {"1", "2"} for m in held}
            server.known_models = set(server.ready_models)
    return gw


def r_index(region: str) -> int:
    return int(region[1:])


def request_us(gw: Any, model: str, number: int) -> float:
    """µs of one request's routing reads (the best of 3 timings of `number` requests)."""
    from gateway.core import _ADMITTED

    _ADMITTED.set(model)  # admission let the request in: its model may be a metrics label
    router = gw.router

    def one() -> None:
        router.latest_version(model)
        gw.model_label(model)
        gw.model_label(model)
        router.route(model, "")

    one()  # a first request after a fleet change builds the index: not a steady request
    return min(timeit.repeat(one, number=number, repeat=3)) / number * 1e6


def measure(root: str, sizes: list[int], number: int) -> dict[str, Any]:
    """One round in this process: every fleet size and shape with the code under `root`."""
    sys.path.insert(0, root)
    from gateway import compiled_build

    figures = {}
    for per_region in [1, *sizes]:
        for placed in (False, True):
            if placed and per_region < PLACED_ON:
                continue
            figures[f"{per_region}/{placed}"] = request_us(
                fleet(per_region, placed), f"m{MODELS // 2}", number
            )
    return {"build": compiled_build.active(), "figures": figures}


def one_round(root: Path, sizes: list[int], number: int) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--measure", str(root), "--sizes"]
    argv += [",".join(map(str, sizes)), "--number", str(number)]
    out = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,50,200", help="servers per region, comma-separated")
    ap.add_argument("--number", type=int, default=1000, help="requests per timing")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians are printed)")
    ap.add_argument("--against", type=Path, help="another checkout measured in the same rounds")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # one round, in a child process
    args = ap.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.measure:
        print(json.dumps(measure(args.measure, sizes, args.number)))
        return
    checkouts = [("this", ROOT)]
    if args.against is not None:
        if not (args.against / "gateway" / "fleet" / "router.py").is_file():
            raise SystemExit(
                f"--against {args.against}: not a skewserve checkout (no gateway/fleet/router.py)"
            )
        checkouts.append(("against", args.against.resolve()))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in checkouts}
    builds = {}
    for r in range(args.rounds):
        for name, root in checkouts if r % 2 == 0 else checkouts[::-1]:
            result = one_round(root, sizes, args.number)
            builds[name] = result["build"]
            runs[name].append(result["figures"])
    print(
        f"# fleet routing: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{REGIONS} regions, {MODELS} models; medians of {args.rounds} alternating rounds; "
        + ", ".join(f"{name}: {root} ({builds[name]} build)" for name, root in checkouts)
    )
    cols = [name for name, _ in checkouts]
    head = " | ".join(f"{c} µs/request | {c} / 3 servers" for c in cols)
    print(f"| servers | shape | {head} |" + (" this / against |" if len(cols) > 1 else ""))
    print("|---:|---|" + "---:|---:|" * len(cols) + ("---:|" if len(cols) > 1 else ""))
    for key in runs["this"][0]:
        per_region, placed = int(key.split("/")[0]), key.endswith("True")
        base_key = "1/False"
        cells, medians = [], {}
        for c in cols:
            m = statistics.median(f[key] for f in runs[c])
            base = statistics.median(f[base_key] for f in runs[c])
            medians[c] = m
            cells.append(f"{m:.2f} | {m / base:.2f}x")
        shape = f"placed on {PLACED_ON}/region" if placed else "all hold all"
        row = f"| {per_region * REGIONS} | {shape} | " + " | ".join(cells) + " |"
        if len(cols) > 1:
            row += f" {medians['this'] / medians['against']:.2f}x |"
        print(row)


if __name__ == "__main__":
    main()
