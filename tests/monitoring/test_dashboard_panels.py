"""Dashboard panels evaluated by Prometheus's own engine (promtool) over synthetic series."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "skewserve-gateway.json"


def _panel(title: str) -> dict:
    dash = json.loads(DASHBOARD.read_text())
    return next(p for p in dash["panels"] if p["title"] == title)


def test_retries_hedges_ejections_panel_shows_every_counter(tmp_path: Path) -> None:
    """All three counters grow at once: the panel must draw three series, one per counter.

    The former single query `sum(A) or sum(B) or sum(C)` drew only retries: `or` keeps the right
    side only for label sets the left lacks, and every `sum()` has the same (empty) label set.
    """
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    panel = _panel("Retries, hedges, ejections")
    series = [
        {"series": 'skewserve_gateway_retries_total{region="us-east",server="a"}', "values": "0+60x10"},
        {"series": 'skewserve_gateway_hedges_total{region="us-east",server="a"}', "values": "0+120x10"},
        {"series": 'skewserve_gateway_ejections_total{region="us-east",server="a"}', "values": "0+1x10"},
    ]
    # What each counter must contribute at 10m: 1 retry/s, 2 hedges/s, 5 ejections in 5 minutes.
    expected = {"skewserve_gateway_retries_total": 1.0, "skewserve_gateway_hedges_total": 2.0}
    expected["skewserve_gateway_ejections_total"] = 5.0
    drawn: set[str] = set()
    for target in panel["targets"]:
        named = [m for m in expected if m in target["expr"]]
        drawn.update(named)
        test = {
            "interval": "1m",
            "input_series": series,
            # A target naming N counters must draw N series, each with its counter's value.
            "promql_expr_test": [
                {
                    "expr": target["expr"],
                    "eval_time": "10m",
                    "exp_samples": [{"labels": "{}", "value": expected[m]} for m in named],
                }
            ],
        }
        path = tmp_path / f"{target['refId']}.yml"
        path.write_text(yaml.safe_dump({"tests": [test]}))
        res = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, f"target {target['refId']}: {res.stdout}{res.stderr}"
    assert drawn == set(expected)


def _promtool_test(tmp_path: Path, name: str, series: list[dict], expr: str, samples: list[dict]) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    test = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [{"expr": expr, "eval_time": "10m", "exp_samples": samples}],
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump({"tests": [test]}))
    res = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, f"{name}: {res.stdout}{res.stderr}"


def test_cascade_row_draws_the_escalation_rate_of_each_predicted_class(tmp_path: Path) -> None:
    """The escalation panel divides escalated by judged items class by class: a rare class the
    edge escalates 3 times in 4 shows 0.75 beside a head class's 0.1, not one pooled rate."""
    dash = json.loads(DASHBOARD.read_text())
    row = next(i for i, p in enumerate(dash["panels"]) if p["type"] == "row")
    assert dash["panels"][row]["title"] == "Cascades (docs/cascade.md)"
    titles = [p["title"] for p in dash["panels"][row + 1 :]]
    assert titles == [
        "Cascade answers/s by stage",
        "Cascade escalation rate by predicted class",
        "Cascade bytes sent upstream/s",
        "Cascade stage latency p50 / p99",
    ]
    labels = 'cascade="digits",stage="edge",class="{}"'
    series = [
        {
            "series": "skewserve_gateway_cascade_judged_items_total{" + labels.format("head") + "}",
            "values": "0+100x10",
        },
        {
            "series": "skewserve_gateway_cascade_escalations_total{" + labels.format("head") + "}",
            "values": "0+10x10",
        },
        {
            "series": "skewserve_gateway_cascade_judged_items_total{" + labels.format("rare") + "}",
            "values": "0+4x10",
        },
        {
            "series": "skewserve_gateway_cascade_escalations_total{" + labels.format("rare") + "}",
            "values": "0+3x10",
        },
    ]
    (target,) = _panel("Cascade escalation rate by predicted class")["targets"]
    expected = [
        {"labels": "{" + labels.format("head") + "}", "value": 0.1},
        {"labels": "{" + labels.format("rare") + "}", "value": 0.75},
    ]
    _promtool_test(tmp_path, "escalation", series, target["expr"], expected)


def test_cascade_row_draws_each_stage_latency_from_answers_only(tmp_path: Path) -> None:
    """Failed stage calls (a stage deadline of seconds) must not lift the answered stage's p99."""
    bucket = 'skewserve_gateway_cascade_stage_seconds_bucket{{cascade="digits",stage="cloud",outcome="{}",le="{}"}}'
    series = [
        {"series": bucket.format("answer", "0.05"), "values": "0+10x10"},
        {"series": bucket.format("answer", "0.1"), "values": "0+10x10"},
        {"series": bucket.format("answer", "+Inf"), "values": "0+10x10"},
        {"series": bucket.format("failure", "0.05"), "values": "0+0x10"},
        {"series": bucket.format("failure", "0.1"), "values": "0+0x10"},
        {"series": bucket.format("failure", "+Inf"), "values": "0+10x10"},
    ]
    p99 = next(t for t in _panel("Cascade stage latency p50 / p99")["targets"] if t["refId"] == "A")
    expected = [{"labels": '{cascade="digits",stage="cloud"}', "value": 0.0495}]
    _promtool_test(tmp_path, "latency", series, p99["expr"], expected)
