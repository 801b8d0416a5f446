"""Every series name the rules, dashboards and autoscaling queries use is one that something exports:
Triton (a live server with its response cache on), the gateway (its registry) or the trainer (its
registry). A renamed metric on either side fails here instead of leaving a panel or alert empty."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.operations.metrics import GatewayMetrics
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from tests.monitoring.stack import TRITON_CACHE, write_monitoring_repo
from tests.waiting import wait_until
from training.metrics_export import RankMetrics

ROOT = Path(__file__).resolve().parents[2]
USERS = [
    ROOT / "deploy" / "prometheus" / "rules.yml",
    ROOT / "deploy" / "grafana" / "skewserve-gateway.json",
    ROOT / "deploy" / "grafana" / "skewserve-training.json",
    ROOT / "deploy" / "k8s" / "base" / "triton-autoscaling.yaml",
    ROOT / "deploy" / "k8s" / "prometheus-adapter.yaml",
]
NAME = re.compile(r"\b(?:nv|skewserve)_\w+")
# Triton exports its GPU series only where it sees a GPU (none here); checked by name on a GPU host.
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def used_names() -> dict[str, list[str]]:
    """name -> the files using it."""
    out: dict[str, list[str]] = {}
    for path in USERS:
        for name in set(NAME.findall(path.read_text())):
            out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def registry_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


@pytest.fixture(scope="module")
def triton_names(
    prepared_triton: PreparedTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[set[str]]:
    work = tmp_path_factory.mktemp("names")
    spec = TritonServerSpec(repository=write_monitoring_repo(work / "repo"), cache_config=TRITON_CACHE)
    server = TritonServer(spec, work / "logs", prepared_triton).start()
    texts: list[str] = []

    def metrics_read() -> bool:  # the metrics port may open a moment after the server is ready
        try:
            with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
                texts.append(r.read().decode())
            return True
        except OSError:
            return False

    try:
        wait_until(metrics_read, 60, "Triton's metrics port to answer")
    finally:
        server.stop()
    text = texts[0]
    yield {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")} | {
        line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")
    }


def test_the_files_use_names_at_all() -> None:
    used = used_names()
    assert any(n.startswith("nv_") for n in used) and any(n.startswith("skewserve_train_") for n in used)
    assert any(n.startswith("skewserve_gateway_") for n in used)


def test_every_used_series_is_exported(triton_names: set[str]) -> None:
    gateway = GatewayMetrics()
    # the fleet's gauges are collected from a snapshot of the gateway's state: an empty fleet here
    gateway.attach_fleet(lambda: {"servers": [], "skew_index": {}, "inflight": 0, "cache_bytes": 0})
    trainer = RankMetrics(0, "127.0.0.1", 0)
    try:
        exported = triton_names | registry_names(gateway.registry) | registry_names(trainer.registry)
    finally:
        trainer.server.shutdown()
    missing = {name: files for name, files in used_names().items() if name not in exported | GPU_ONLY}
    assert not missing, f"used but exported by nothing: {missing}"
