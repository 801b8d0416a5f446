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
