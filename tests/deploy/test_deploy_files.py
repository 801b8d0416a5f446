"""Deployment files are validated here (no Docker engine or cluster on these machines)."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.metrics import ControllerMetrics
from gateway.config import ConfigError, load_gateway_config
from skewserve.stack import load_stack_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
METRIC = re.compile(r"\b(skewserve_gateway_[a-z_]+?)(?:_bucket|_count|_sum)?\b")


def _metric_names() -> set[str]:
    import asyncio

    from gateway.config import GatewayConfig
    from gateway.core import Gateway

    async def render() -> str:
        gw = Gateway(
            GatewayConfig(
                home_region="a",
                regions=[{"name": "a", "servers": [{"name": "s", "http": "h:1", "grpc": "h:2"}]}],
            )
        )
        text = gw.metrics.render().decode()
        await gw.stop()
        return text

    text = asyncio.run(render())
    return {m.group(1) for m in re.finditer(r"^# TYPE (skewserve_gateway_\w+)", text, re.M)}


def test_prometheus_rules_check_and_unit_tests_pass() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (make setup installs Debian's prometheus package)"
    subprocess.run(
        [promtool, "check", "rules", "rules.yml"], cwd=DEPLOY / "prometheus", check=True, capture_output=True
    )
    res = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"],
        cwd=DEPLOY / "prometheus",
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_rules_and_dashboard_only_use_metrics_the_gateway_exports() -> None:
    exported = _metric_names()
    texts = [
        (DEPLOY / "prometheus" / "rules.yml").read_text(),
        (DEPLOY / "grafana" / "skewserve-gateway.json").read_text(),
    ]
    used = {m.group(1) for t in texts for m in METRIC.finditer(t)}
    counters = {n.removesuffix("_total") for n in exported}
    unknown = {u for u in used if u not in exported and u.removesuffix("_total") not in counters}
    assert not unknown, f"not exported by the gateway: {unknown}"


def test_dashboard_is_valid_grafana_json() -> None:
    dash = json.loads((DEPLOY / "grafana" / "skewserve-gateway.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert dash["uid"] == "skewserve-gateway" and len(panels) >= 8
    assert all(p["targets"] and p["targets"][0]["expr"] for p in panels)
    assert [p["title"] for p in dash["panels"] if p["type"] == "row"] == ["Cascades (docs/cascade.md)"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_example_configs_are_valid_and_hold_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"cache\.hmac_secret must be set"):
        load_gateway_config(DEPLOY / "gateway.example.yaml")  # no secret that passes validation
    monkeypatch.setenv("SKEWSERVE_GATEWAY_CACHE__HMAC_SECRET", secrets.token_hex(32))
    assert load_gateway_config(DEPLOY / "gateway.example.yaml").auth.keys == []
    cfg = load_stack_config(DEPLOY / "stack.local.yaml")
    assert cfg.regions == {"us-east": 2, "eu-west": 1}


def test_controller_rules_check_and_unit_tests_pass() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (make setup installs Debian's prometheus package)"
    for args in (["check", "rules", "controller-rules.yml"], ["test", "rules", "controller-rules_test.yml"]):
        res = subprocess.run([promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    alerts = {
        r["alert"]
        for g in _yaml(DEPLOY / "prometheus" / "controller-rules.yml")["groups"]
        for r in g["rules"]
    }
    tested = {
        t["alertname"]
        for c in _yaml(DEPLOY / "prometheus" / "controller-rules_test.yml")["tests"]
        for t in c["alert_rule_test"]
    }
    assert alerts == tested  # each alert fires (and stays quiet) in a unit test


def _yaml(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


CONTROLLER_METRIC = re.compile(r"\b(skewserve_controller_[a-z_]+)\b")


def test_controller_rules_and_dashboard_use_only_metrics_the_controller_exports() -> None:
    """The names the alerts and panels read are the ones controller/metrics.py registers."""
    registry = ControllerMetrics().registry
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {f.name + s for f in registry.collect() for s in suffixes.get(f.type, ("",))}
    texts = [
        (DEPLOY / "prometheus" / "controller-rules.yml").read_text(),
        (DEPLOY / "grafana" / "skewserve-controller.json").read_text(),
    ]
    used = {m.group(1) for t in texts for m in CONTROLLER_METRIC.finditer(t)}
    assert used and not used - exported, f"not exported by the controller: {used - exported}"


def test_controller_dashboard_is_valid_grafana_json_whose_queries_parse(tmp_path: Path) -> None:
    dash = json.loads((DEPLOY / "grafana" / "skewserve-controller.json").read_text())
    assert dash["uid"] == "skewserve-controller"
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(rows) == 1 and len(panels) >= 6 and all(p["targets"] for p in panels)
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:panel_{p['id']}_{t['refId']}", "expr": t["expr"]}
                    for p in panels
                    for t in p["targets"]
                ],
            }
        ]
    }
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (make setup installs Debian's prometheus package)"
    res = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "dashboard.yml")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
