"""Local autoscaling under a locust ramp and spike: the run behind the README's autoscaling figure.

`skewserve up --autoscale` as a library (LocalStack) serving `lt`, exported from a
freshly trained small artifact, a locust ramp (to 8 users) then a spike (3 -> 12 -> 3 users)
through the gateway, target 1.2 requests in flight per server, 10 s cool-down. Prints the
controller's timeline and the load's totals, and writes the figure.

The test suite checks the controller's behaviour with a load the test sets exactly
(tests/skewserve/test_local_autoscale.py); this script shows it under a real load generator, whose
outcome depends on the machine's speed.

Usage: python benchmarks/autoscale_local.py [--out loadtests/autoscaling-local.png]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from exporter.pipeline import export_artifact
from loadtests.mix import MixSettings
from loadtests.runner import LoadTestSpec, run_loadtest
from skewserve.autoscale import AutoscalePolicy
from skewserve.local_autoscale import plot_autoscaling
from skewserve.stack import LocalStack, StackConfig
from training.config import TrainConfig
from training.launch import train
from training.synth import SynthSpec, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("autoscaling-local.png"))
    parser.add_argument("--target", type=float, default=1.2, help="requests in flight per server")
    args = parser.parse_args()
    policy = AutoscalePolicy(
        signal="inflight",
        target=args.target,
        min_servers=1,
        max_servers=3,
        scale_down_window_s=10,
        window_s=3,
        interval_s=0.5,
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write(
            SynthSpec(n_classes=5, imbalance_ratio=20, n_max=400, n_features=8, n_informative=6, seed=2),
            work / "data",
        )
        train(TrainConfig(data_dir=work / "data", out_dir=work / "art", epochs=4, width=32, progress=False))
        export_artifact(work / "art", work / "repo", "lt", tensorrt="off")
        cfg = StackConfig(
            repository=work / "repo",
            regions={"local": 1},
            autoscale=policy,
            gateway={
                "home_region": "local",
                "listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0},
                "cache": {"backend": "none"},
                "health": {"interval_s": 0.2},
            },
        )
        results = []
        with LocalStack(cfg, work / "stack") as stack:
            scaler = stack.autoscalers[0]
            for shape, users, duration in (("ramp", 8, 30), ("spike", 12, 40)):
                spec = LoadTestSpec(
                    target=f"http://{stack.gateway_http}",
                    protocol="http",
                    mix=MixSettings(model="lt", n_features=8),
                    users=users,
                    spawn_rate=users,
                    duration_s=duration,
                    shape=shape,
                    out_dir=work / shape,
                )
                results.append(run_loadtest(spec))
            deadline = time.monotonic() + 90  # the cool-down after the load, bounded
            while time.monotonic() < deadline and scaler.timeline[-1].servers > policy.min_servers:
                time.sleep(0.2)
            timeline = list(scaler.timeline)
        plot_autoscaling(timeline, policy, [r.files["history"] for r in results], args.out)
    print(f"{'t (s)':>8} {'servers':>7} {'in flight':>9} {'desired':>7}")
    for p in timeline:
        print(f"{p.t - timeline[0].t:8.1f} {p.servers:7d} {p.signal:9.2f} {p.desired:7d}")
    for shape, r in zip(("ramp", "spike"), results, strict=True):
        print(f"{shape}: {r.total.requests} requests, {r.total.failures} failed")
    print(f"servers at most {max(p.servers for p in timeline)}; figure: {args.out}")


if __name__ == "__main__":
    main()
