"""Every rule and dashboard expression, evaluated by a real Prometheus scraping a real local stack.

Stack: two tritonserver processes (Triton's response cache on) behind the gateway, steady traffic.
Prometheus scrapes Triton's metrics ports and the gateway's ops listener and evaluates a copy of
deploy/prometheus/rules.yml with short `for:`; killing one Triton must fire the alerts.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway, start_fleet, stop_fleet
from tests.monitoring.prometheus_server import PrometheusServer, fast_rules_copy
from tests.monitoring.stack import TRITON_CACHE, Traffic, write_monitoring_repo

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "skewserve-gateway.json"

# Expressions that must return finite samples once traffic flows (the rest depend on events:
# retries, spill-overs, shedding, errors, or on GPUs, which this machine lacks).
CORE = {
    "skewserve:gateway_requests:rate1m": "positive",
    "skewserve:gateway_latency_p99:5m": "finite",
    "skewserve:gateway_cache_hit_ratio:5m": "positive",
    "skewserve_gateway_upstream_inflight": "finite",
    "skewserve:triton_requests:rate1m": "positive",
    "skewserve:triton_queue_us_per_request:rate1m": "finite",
    "skewserve:triton_pending_per_server:avg": "finite",
    "skewserve:triton_executions_per_inference:rate5m": "positive",
    'skewserve:triton_cache_hit_ratio:rate5m{model="tcached"}': "positive",
    "sum by (instance) (nv_inference_pending_request_count)": "finite",
    "skewserve:triton_inflight:rate1m": "positive",
}


# Expressions that stay empty on this stack, each for a stated reason: an alert that is not firing
# (the kill test below fires the Triton ones), an event the steady traffic never causes, or a GPU.
_HEALTHY = "an alert's condition: false while this stack is healthy"
_KILL = "an alert's condition: fires in test_killing_a_triton_server_fires_its_alerts below"
_NO_EVENT = "counts events the steady traffic never causes (errors, retries, hedges, spill-overs, shedding)"
_GPU = "Triton exports GPU series only where it sees a GPU"
_TRAINING = "training series: tests/monitoring/test_training_metrics_live.py evaluates them on a live run"
_CASCADE = "cascade series: this stack serves no cascade (tests/gateway/test_cascade.py counts them)"
_KEDA = "selects pods by the cluster's namespace/pod labels, which local targets do not carry"
EMPTY_HERE: dict[str, str] = {
    "SkewserveHighErrorRate": _HEALTHY,
    "SkewserveHighP99Latency": _HEALTHY,
    "SkewserveRegionSkewed": _HEALTHY,
    "SkewserveSpillingOver": _HEALTHY,
    "SkewserveCacheTampering": _HEALTHY,
    "SkewserveTritonQueueing": _HEALTHY,
    "SkewserveTritonFailing": _HEALTHY,
    "SkewserveGpuMemoryNearlyFull": _GPU,
    "SkewserveGpuSaturated": _GPU,
    "SkewserveUpstreamDown": _KILL,
    "SkewserveTritonDown": _KILL,
    "skewserve:gateway_error_ratio:rate5m": _NO_EVENT,
    "Error ratio by model [A]": _NO_EVENT,
    "Spill-overs/s [A]": _NO_EVENT,
    "Retries, hedges, ejections [A]": _NO_EVENT,
    "Retries, hedges, ejections [B]": _NO_EVENT,
    "Retries, hedges, ejections [C]": _NO_EVENT,
    "Shed requests (admission) [A]": _NO_EVENT,
    "Cascade answers/s by stage [A]": _CASCADE,
    "Cascade answers/s by stage [B]": _CASCADE,
    "Cascade escalation rate by predicted class [A]": _CASCADE,
    "Cascade bytes sent upstream/s [A]": _CASCADE,
    "Cascade stage latency p50 / p99 [A]": _CASCADE,
    "Cascade stage latency p50 / p99 [B]": _CASCADE,
    "skewserve:gpu_memory_used:ratio": _GPU,
    "skewserve:gpu_utilization:avg1m": _GPU,
    "GPU utilisation [A]": _GPU,
    "GPU memory used [A]": _GPU,
    "GPU memory used [B]": _GPU,
    "skewserve:train_samples_per_s:rate1m": _TRAINING,
    "skewserve:train_busy_s_per_step:rate1m": _TRAINING,
    "skewserve:train_rank_imbalance:rate1m": _TRAINING,
    "skewserve:train_data_wait_fraction:rate1m": _TRAINING,
    "skewserve:train_allreduce_wait_fraction:rate1m": _TRAINING,
    "SkewserveTrainingRankImbalance": _TRAINING,
    "SkewserveTrainingGradNormNotFinite": _TRAINING,
    "keda inflight-per-server": _KEDA,
    "keda queue-time": _KEDA,
}


def rule_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    return [(r.get("record") or r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def keda_expressions() -> list[tuple[str, str]]:
    """The Triton ScaledObject's trigger queries (cluster label selectors match nothing here)."""
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "triton-autoscaling.yaml").read_text())
    return [(f"keda {t['name']}", t["metadata"]["query"]) for d in docs if d for t in d["spec"]["triggers"]]


def dashboard_expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [
        (f"{p['title']} [{t['refId']}]", t["expr"])
        for p in dash["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]


@pytest.fixture(scope="module")
def live(
    prepared_triton: PreparedTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("monitoring")
    repo = write_monitoring_repo(work / "repo")
    fleet = start_fleet(repo, {"us-east": 2}, work / "logs", prepared_triton, cache_config=TRITON_CACHE)
    gw: GatewayUnderTest | None = None
    prom: PrometheusServer | None = None
    traffic: Traffic | None = None
    try:
        gw = launch_gateway(
            gateway_config(fleet, cache={"backend": "memory", "models": ["affine"]}), work / "gw"
        )
        traffic = Traffic(gw.http)
        traffic.start()
        servers = fleet["us-east"]
        prom = PrometheusServer(
            work / "prom",
            {
                "skewserve-gateway": [gw.ops],
                "triton": [f"{s.spec.host}:{s.metrics_port}" for s in servers],
            },
            [fast_rules_copy(RULES, work / "rules.fast.yml")],
        ).start()
        # Data for rate()s: two scrapes of each target after traffic began, and rule results.
        prom.wait_for(
            # Sequential traffic goes to the least-loaded server, often always the same one.
            lambda: len(prom.query("skewserve:triton_requests:rate1m > 0")) >= 2,  # both models
            90,
            "Triton to report inference rates for both models",
        )
        yield {"prom": prom, "fleet": fleet, "gw": gw, "traffic": traffic}
    finally:
        if traffic is not None:
            traffic.stop()
        if prom is not None:
            prom.stop()
        if gw is not None:
            gw.stop()
        stop_fleet(fleet)


@pytest.mark.parametrize("name,expr", rule_expressions() + dashboard_expressions() + keda_expressions())
def test_every_rule_and_dashboard_expression_evaluates(live: dict[str, Any], name: str, expr: str) -> None:
    """It parses and runs (the server's own error otherwise), and returns samples unless it waits on
    an event this stack does not produce, named with the reason in EMPTY_HERE."""
    prom: PrometheusServer = live["prom"]
    prom.query(expr)
    if name in EMPTY_HERE:
        return
    prom.wait_for(lambda: bool(prom.query(expr)), 30, f"{name} to return samples")


def test_every_expression_said_to_be_empty_exists() -> None:
    """A renamed panel or rule must not leave a stale exemption behind."""
    names = {name for name, _ in rule_expressions() + dashboard_expressions() + keda_expressions()}
    assert set(EMPTY_HERE) <= names, set(EMPTY_HERE) - names


def test_every_rule_group_evaluates_without_error(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    prom.wait_for(
        lambda: all(g["lastEvaluation"][:4] != "0001" for g in prom.api("rules")["groups"]),
        30,
        "every rule group to be evaluated once",
    )
    bad = [
        (r["name"], r.get("lastError"))
        for g in prom.api("rules")["groups"]
        for r in g["rules"]
        if r["health"] != "ok"
    ]
    assert not bad


@pytest.mark.parametrize("expr,kind", CORE.items())
def test_core_expressions_return_data(live: dict[str, Any], expr: str, kind: str) -> None:
    prom: PrometheusServer = live["prom"]

    def has_data() -> bool:
        values = [float(s["value"][1]) for s in prom.query(expr)]
        ok = [v for v in values if math.isfinite(v) and (v > 0 or kind == "finite")]
        return bool(ok)

    prom.wait_for(has_data, 60, f"{expr} to return {kind} samples")


def test_killing_a_triton_server_fires_its_alerts(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    victim: TritonServer = live["fleet"]["us-east"][1]
    instance = f"{victim.spec.host}:{victim.metrics_port}"
    assert not prom.firing("SkewserveTritonDown")
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    prom.wait_for(
        lambda: prom.firing("SkewserveTritonDown", instance=instance),
        60,
        f"SkewserveTritonDown for {instance}",
    )
    # The gateway's view of the same fault: the server is out of rotation.
    prom.wait_for(
        lambda: prom.firing("SkewserveUpstreamDown", server=victim.spec.name),
        60,
        f"SkewserveUpstreamDown for {victim.spec.name}",
    )
    # The survivor is not reported down.
    alive = live["fleet"]["us-east"][0]
    assert not prom.firing("SkewserveTritonDown", instance=f"{alive.spec.host}:{alive.metrics_port}")
