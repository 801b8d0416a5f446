"""Placement of many models under skewed, shifting popularity: placement by demand against LRU
placement and every model everywhere, on the same trace. The run behind the README's placement
figures (`make bench-placement`).

Each policy gets the same local stack (`skewserve up` as a library): 3 tritonservers in explicit
model control with room for `--room` models each, `--models` tiny Python-backend models, the
controller and the gateway (cold starts through the controller's demand API), and the same locust
trace: Zipf popularity (s = 1.1) over the models, whose ranking rotates halfway (the models ranked
lowest become the hottest). Policies:

- demand: copies follow each model's measured rate, eviction weighs idle time against reload cost
  (controller/placement.py);
- lru: one copy per requested model, the least recently used evicted (ModelMesh, Ray Serve's
  multiplexing; controller/placement_lru.py);
- everywhere: every server loads every model, capacity ignored: the latency reference where all
  models fit.

Each policy first serves `--warmup` seconds of the first ranking, unmeasured (placement settles),
then the measured run. Printed per policy: requests, failed requests, p50/p99 for hot (ranks 1-3), warm (4-10) and cold
(the rest) models, model loads during the run and per hour, and the most memory a server held
(model footprints over its capacity, sampled every second from what each server has loaded).
Absolute latencies depend on the machine; compare policies within one run.

Usage: python benchmarks/placement_bench.py [--duration 150] [--out benchmarks/placement.png]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from controller.config import ControllerConfig
from controller.placement import CopyBounds, PlacementConfig
from controller.triton_admin import TritonAdmin
from repository.disk_store import DiskStateStore
from skewserve.sample_models import write_affine_model
from skewserve.stack import LocalStack, StackConfig

POLICIES = ("demand", "lru", "everywhere")
GROUPS = ("hot", "warm", "cold")
FOOTPRINT_OVERHEAD = 1.5  # PlacementConfig's default: files x 1.5 (the Python backend reports no memory)


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    failures: int = 0
    latency_ms: dict[str, tuple[float, float]] = field(default_factory=dict)  # group -> (p50, p99)
    loads: int = 0
    duration_s: float = 0.0
    peak_fraction: float = 0.0  # most model bytes one server held / its capacity
    over_capacity: int = 0  # samples where a server held more than its capacity
    loads_timeline: list[tuple[float, int]] = field(default_factory=list)
    failure_examples: list[str] = field(default_factory=list)

    @property
    def loads_per_hour(self) -> float:
        return self.loads * 3600 / self.duration_s if self.duration_s else 0.0


class Sampler:
    """What each server has loaded, every second: peak bytes against capacity, loads over time."""

    def __init__(self, stack: LocalStack, key: str, footprint: int, capacity: int) -> None:
        self.stack, self.key, self.footprint, self.capacity = stack, key, footprint, capacity
        self.peak = 0
        self.over = 0
        self.timeline: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()
        self.base_loads = self.loads()

    def loads(self) -> int:
        return sum(s.log_text().count("successfully loaded") for s in self.stack.fleet.servers)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for server in self.stack.fleet.servers:
                admin = TritonAdmin(server.spec.name, server.http_address, self.key, 10.0)
                try:
                    held = sum(len(v) for v in admin.loaded().values()) * self.footprint
                except Exception:  # a server busy loading: the next sample counts it
                    continue
                finally:
                    admin.close()
                self.peak = max(self.peak, held)
                self.over += held > self.capacity
            self.timeline.append((time.monotonic() - self.started, self.loads() - self.base_loads))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _locust(
    target: str, models: list[str], args: argparse.Namespace, out: Path, duration: float, shift: bool = True
) -> dict[str, dict[str, str]]:
    """Run the trace (the ranking rotated halfway when `shift`); locust's stats rows by request name."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PLACEMENT_MODELS": ",".join(models),
        "PLACEMENT_ZIPF_S": str(args.zipf_s),
        "PLACEMENT_SHIFT_AT": str(time.time() + (duration / 2 if shift else 1e9)),
        "PLACEMENT_SHIFT": str(len(models) // 2),
        "PLACEMENT_RATE": str(args.rate),
    }
    locust = Path(sys.executable).with_name("locust")
    subprocess.run(
        [
            str(locust),
            "-f",
            str(Path(__file__).with_name("placement_locust.py")),
            "--headless",
            "--users",
            str(args.users),
            "--spawn-rate",
            str(args.users),
            "--run-time",
            f"{duration:.0f}s",
            "--host",
            target,
            "--csv",
            str(out / "locust"),
            "--only-summary",
            "--loglevel",
            "WARNING",
        ],
        env=env,
        check=False,  # locust exits 1 when any request failed: the figures say how many
        stdout=subprocess.DEVNULL,
        stderr=(out / "locust.log").open("wb"),  # its own summary: the table below says it once
    )
    with (out / "locust_stats.csv").open() as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def run_policy(policy: str, args: argparse.Namespace, work: Path) -> PolicyResult:
    repo = work / policy / "repo"
    models = [f"m{i:02d}" for i in range(args.models)]
    for m in models:
        write_affine_model(repo, m)
    footprint = int(DiskStateStore(repo).version_bytes(models[0], 1) * FOOTPRINT_OVERHEAD)
    capacity = int(footprint * (args.room + 0.5))
    placement = (
        None
        if policy == "everywhere"
        else PlacementConfig(
            server_capacity_bytes=capacity,
            policy=policy,  # type: ignore[arg-type]
            target_rps_per_copy=args.target_rps,
            recent_use_guard_s=args.guard_s,
            default=CopyBounds(min_copies=0),  # placed by demand, from the first request
        )
    )
    cfg = StackConfig(
        repository=repo,
        regions={"local": 3},
        controller=ControllerConfig(
            interval_s=1.0, retry_after_s=1.0, load_timeout_s=120, placement=placement
        ),
        gateway={
            "home_region": "local",
            "listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0},
            "cache": {"backend": "none"},
            "health": {"interval_s": 0.5},
        },
    )
    result = PolicyResult(policy)
    with LocalStack(cfg, work / policy / "logs") as stack:
        target = f"http://{stack.gateway_http}"
        if args.warmup:  # the first ranking until placement settles: not measured
            _locust(target, models, args, work / policy / "warmup", args.warmup, shift=False)
        sampler = Sampler(stack, stack.control_key, footprint, capacity)
        started = time.monotonic()
        with sampler:
            rows = _locust(target, models, args, work / policy, args.duration)
        result.duration_s = time.monotonic() - started
        result.loads = sampler.loads() - sampler.base_loads
        result.loads_timeline = sampler.timeline
    result.peak_fraction = sampler.peak / capacity
    result.over_capacity = sampler.over if placement is not None else 0
    total = rows.get("Aggregated", {})
    result.requests = int(total.get("Request Count", 0))
    result.failures = int(total.get("Failure Count", 0))
    for group in GROUPS:
        row = rows.get(group)
        if row is not None and int(row["Request Count"]):
            result.latency_ms[group] = (float(row["50%"]), float(row["99%"]))
    failures = work / policy / "locust_failures.csv"
    if failures.is_file():
        with failures.open() as f:
            result.failure_examples = [r["Error"][:160] for r in csv.DictReader(f)][:3]
    return result


def print_table(results: list[PolicyResult]) -> None:
    head = f"{'policy':<11} {'requests':>8} {'failed':>6} "
    head += " ".join(f"{g + ' p50/p99 ms':>20}" for g in GROUPS)
    head += f" {'loads':>6} {'loads/h':>8} {'peak mem':>9}"
    print(head)
    for r in results:
        cells = " ".join(
            f"{r.latency_ms[g][0]:>9.0f}/{r.latency_ms[g][1]:<10.0f}" if g in r.latency_ms else f"{'-':>20}"
            for g in GROUPS
        )
        mem = "n/a" if r.policy == "everywhere" else f"{r.peak_fraction:.0%}"
        print(
            f"{r.policy:<11} {r.requests:>8} {r.failures:>6} {cells} {r.loads:>6} {r.loads_per_hour:>8.0f} {mem:>9}"
        )
    by = {r.policy: r for r in results}
    demand, lru, everywhere = by.get("demand"), by.get("lru"), by.get("everywhere")
    if demand and lru and lru.loads:
        print(f"loads: demand / LRU = {demand.loads / lru.loads:.2f}")
    if demand and everywhere and "hot" in demand.latency_ms and "hot" in everywhere.latency_ms:
        ratio = demand.latency_ms["hot"][1] / max(everywhere.latency_ms["hot"][1], 1e-9)
        print(f"hot-model p99: demand / every model everywhere = {ratio:.2f}")
    for r in results:
        if r.over_capacity:
            print(f"{r.policy}: a server held more than its capacity in {r.over_capacity} samples")
        for example in r.failure_examples:
            print(f"{r.policy} failure: {example}")


def plot(results: list[PolicyResult], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, loads) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [g + i * width for g in range(len(GROUPS))]
        lat.bar(xs, [r.latency_ms.get(g, (0, 0))[1] for g in GROUPS], width, label=r.policy)
        if r.loads_timeline:
            ts, ns = zip(*r.loads_timeline, strict=True)
            loads.plot(ts, ns, label=r.policy)
    lat.set_xticks([g + width * (len(results) - 1) / 2 for g in range(len(GROUPS))], list(GROUPS))
    lat.set_ylabel("p99 latency (ms, log)")
    lat.set_yscale("log")
    lat.set_title(f"{args.models} models, 3 servers with room for {args.room}, Zipf s={args.zipf_s}")
    lat.legend()
    loads.axvline(args.duration / 2, color="grey", linestyle="--", label="popularity shift")
    loads.set_xlabel("seconds")
    loads.set_ylabel("model loads (cumulative)")
    loads.set_title("loads over the run")
    loads.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=30)
    parser.add_argument("--room", type=int, default=8, help="models each server has room for")
    parser.add_argument("--duration", type=int, default=150, help="seconds of load per policy")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured seconds of the first ranking")
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second per user")
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--target-rps", type=float, default=1.5, help="demand: requests/s one copy serves")
    parser.add_argument("--guard-s", type=float, default=3.0, help="never evict a model used this recently")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/placement.png"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            print(f"running {policy} ({args.duration}s of load)...", flush=True)
            results.append(run_policy(policy, args, Path(tmp)))
    print(
        f"\n{args.models} models, 3 servers with room for {args.room} each, Zipf s={args.zipf_s}, "
        f"{args.users} users x {args.rate:g} req/s, popularity rotated at {args.duration / 2:.0f}s"
    )
    print_table(results)
    plot(results, args)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
