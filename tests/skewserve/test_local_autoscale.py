"""`skewserve up --autoscale` on one machine: real Triton servers added and removed under locust.

A locust ramp, then a spike, through the gateway; the controller reads Triton's queue time per
request, the gateway learns of servers through DNS discovery (a loopback DNS server).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loadtests.mix import MixSettings
from loadtests.runner import LoadTestSpec, run_loadtest
from skewserve.autoscale import AutoscalePolicy, recommend
from skewserve.local_autoscale import plot_autoscaling
from skewserve.stack import LocalStack, StackConfig

# Requests inside each Triton server on average; on 2 shared cores queue time does not fall when a
# server is added (the servers compete for the same CPUs), the per-server in-flight share does.
TARGET = float(os.environ.get("SKEWSERVE_AUTOSCALE_TEST_TARGET", "1.2"))


@pytest.mark.slow
def test_servers_follow_the_queue_under_ramp_and_spike_with_zero_failures(
    gateway_repo: Path, tmp_path: Path
) -> None:
    policy = AutoscalePolicy(
        signal="inflight",
        target=TARGET,
        min_servers=1,
        max_servers=3,
        scale_down_window_s=10,
        window_s=3,
        interval_s=0.5,
    )
    cfg = StackConfig(
        repository=gateway_repo,
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
    with LocalStack(cfg, tmp_path / "stack") as stack:
        scaler = stack.autoscalers[0]
        for shape, users, duration in (("ramp", 8, 30), ("spike", 12, 40)):
            results.append(
                run_loadtest(
                    LoadTestSpec(
                        target=f"http://{stack.gateway_http}",
                        protocol="http",
                        mix=MixSettings(model="lt", n_features=8),
                        users=users,
                        spawn_rate=users,
                        duration_s=duration,
                        shape=shape,
                        out_dir=tmp_path / shape,
                    )
                )
            )
        # Load over: back to min_servers after the cool-down (bounded wait on the controller's state).
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (
            scaler.timeline and scaler.timeline[-1].servers == policy.min_servers
        ):
            time.sleep(0.2)
        timeline = list(scaler.timeline)
        servers_after = len(scaler.servers)
    png = plot_autoscaling(
        timeline, policy, [r.files["history"] for r in results], tmp_path / "autoscaling.png"
    )
    out = os.environ.get("SKEWSERVE_AUTOSCALE_PLOT")
    if out:
        Path(out).write_bytes(png.read_bytes())
    for p in timeline:
        print(f"{p.t:8.1f} servers={p.servers} signal={p.signal:9.0f} desired={p.desired}")
    assert [r.total.failures for r in results] == [0, 0] and all(r.total.requests > 100 for r in results)
    ups = [p for p in timeline if p.desired > p.servers]
    downs = [p for p in timeline if p.desired < p.servers]
    assert ups and downs, "the load must make the controller add and then remove servers"
    assert max(p.servers for p in timeline) >= 2
    for p in ups:  # added only when the signal crossed its target
        assert p.signal > policy.target * (1 + policy.tolerance)
    for p in downs:  # removed only once the cool-down passed since anything asked for more
        higher = [q for q in timeline if q.t < p.t and recommend(policy, q.servers, q.signal) > p.desired]
        assert higher, "a removal follows a time when more servers were recommended"
        assert p.t - higher[-1].t > policy.scale_down_window_s
    assert servers_after == policy.min_servers


def test_up_autoscale_flag_serves_through_discovered_servers_and_stops_them(
    affine_repo: Path, tmp_path: Path
) -> None:
    import json
    import re
    import signal
    import urllib.request

    import yaml

    from tests.process_helpers import cli_process, read_until

    cfg = tmp_path / "stack.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "repository": str(affine_repo),
                "model_control_mode": "none",
                "regions": {"local": 1},
                "gateway": {"listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0}},
            }
        )
    )
    with cli_process("up", "--config", str(cfg), "--autoscale", "--log-dir", str(tmp_path / "logs")) as proc:
        text = read_until(proc, "press Ctrl-C")
        assert re.search(r"autoscaling local: 1-4 servers on inflight \(target 2, cool-down 60s\)", text), (
            text
        )
        gw = re.search(r"gateway\s+│\s+local \(home\)\s+│\s+gateway\s+│\s+(http://[\d.]+:\d+)", text)
        assert gw, text
        pids = [int(p) for p in re.findall(r"triton\s+│.*│\s+(\d+)\s+│", text)]
        assert len(pids) == 1, text
        body = json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
        ).encode()
        req = urllib.request.Request(
            f"{gw.group(1)}/v2/models/affine/infer", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:  # routed to the server DNS discovery found
            assert json.loads(r.read())["outputs"][0]["data"] == [3.0] * 4
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "stopped the gateway and all servers" in rest
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
