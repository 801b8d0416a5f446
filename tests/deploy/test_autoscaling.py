"""Autoscaling manifests: KEDA's ScaledObject for Triton (a CRD: checked field by field here, the
Kubernetes schema set has no KEDA types) and the gateway's HPA, both against the local policy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from skewserve.autoscale import AutoscalePolicy

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _scaled_object() -> dict[str, Any]:
    (doc,) = _docs(K8S / "base" / "triton-autoscaling.yaml")
    return doc


def test_triton_scaled_object_is_well_formed_and_targets_the_triton_statefulset() -> None:
    so = _scaled_object()
    assert (so["apiVersion"], so["kind"], so["metadata"]["name"]) == (
        "keda.sh/v1alpha1",
        "ScaledObject",
        "triton",
    )
    allowed = {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "advanced",
        "triggers",
    }
    assert set(so["spec"]) <= allowed | {"cooldownPeriod", "idleReplicaCount", "fallback"}
    ref = so["spec"]["scaleTargetRef"]
    targets = {(d["kind"], d["metadata"]["name"]) for d in _docs(K8S / "base" / "triton.yaml")}
    assert (ref["kind"], ref["name"]) in targets and ref["apiVersion"] == "apps/v1"
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    assert (
        "triton-autoscaling.yaml"
        in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"]
    )
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
        meta = trigger["metadata"]
        assert set(meta) == {"serverAddress", "query", "threshold", "ignoreNullValues"}
        assert meta["serverAddress"].startswith("http") and float(meta["threshold"]) > 0
        assert isinstance(meta["threshold"], str)  # KEDA reads metadata as strings only


def test_scaled_object_windows_and_signal_match_the_local_policy() -> None:
    """The local controller (skewserve up --autoscale) runs the same signal, target and windows."""
    so = _scaled_object()
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == AutoscalePolicy().scale_up_window_s == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= AutoscalePolicy().scale_down_window_s
    assert behavior["scaleUp"]["policies"] == [
        {"type": "Pods", "value": AutoscalePolicy().max_step_up, "periodSeconds": 60}
    ]
    assert behavior["scaleDown"]["policies"][0]["value"] == AutoscalePolicy().max_step_down
    inflight = next(t for t in so["spec"]["triggers"] if t["name"] == "inflight-per-server")
    assert inflight["metricType"] == "AverageValue"
    assert "rate(nv_inference_request_duration_us" in inflight["metadata"]["query"]
    assert float(inflight["metadata"]["threshold"]) == AutoscalePolicy().target
    assert AutoscalePolicy().signal == "inflight"


def test_scaled_object_queries_parse_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    rules = {
        "groups": [
            {
                "name": "keda",
                "rules": [
                    {"record": f"keda:{t['name'].replace('-', '_')}", "expr": t["metadata"]["query"]}
                    for t in _scaled_object()["spec"]["triggers"]
                ],
            }
        ]
    }
    (tmp_path / "keda.yml").write_text(yaml.safe_dump(rules))
    res = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "keda.yml")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_gateway_hpa_scales_on_cpu_and_its_own_in_flight_requests_with_windows() -> None:
    hpa = next(d for d in _docs(K8S / "base" / "gateway.yaml") if d["kind"] == "HorizontalPodAutoscaler")
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == "skewserve_gateway_inflight"
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0
    adapter = yaml.safe_load((K8S / "prometheus-adapter.yaml").read_text())
    served = [r["name"]["as"] for r in adapter["rules"]["custom"]]
    assert "skewserve_gateway_inflight" in served


def test_an_empty_query_never_reads_as_zero_and_a_pods_workers_are_summed() -> None:
    """KEDA's Prometheus triggers treat an empty answer as an error (the count stays), not as 0
    (which would scale Triton in); the adapter sums a gateway pod's per-worker in-flight gauges."""
    for trigger in _scaled_object()["spec"]["triggers"]:
        assert trigger["metadata"].get("ignoreNullValues") == "false", trigger["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter.yaml").read_text())
    (rule,) = [r for r in adapter["rules"]["custom"] if r["name"]["as"] == "skewserve_gateway_inflight"]
    assert rule["metricsQuery"].startswith("sum by (<<.GroupBy>>) (")


def test_workloads_an_autoscaler_owns_declare_no_replica_count() -> None:
    """A `replicas` in a scaled workload resets the autoscaler's count at every apply."""
    kust = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    base = [d for f in kust["resources"] for d in _docs(K8S / "base" / f)]
    targets = {
        (d["spec"]["scaleTargetRef"]["kind"], d["spec"]["scaleTargetRef"]["name"])
        for d in base
        if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
    }
    assert targets == {("StatefulSet", "triton"), ("Deployment", "skewserve-gateway")}
    overlays = [d for f in sorted((K8S / "overlays").glob("*/*.yaml")) for d in _docs(f) if "kind" in d]
    for doc in base + overlays:
        if "metadata" in doc and (doc["kind"], doc["metadata"]["name"]) in targets:
            assert "replicas" not in doc.get("spec", {}), (
                f"{doc['kind']}/{doc['metadata']['name']} sets replicas"
            )
