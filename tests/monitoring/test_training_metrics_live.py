"""A real 2-rank torchrun training run, scraped live by a real Prometheus (one endpoint per rank).

Rank 1 is slowed 3x with speed balancing off, so the ranks are imbalanced for as long as the run
lasts: the imbalance recording rule must see it and the alert (copy with `for: 1s`) must fire,
while the run is still going.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from skewserve.ports import consecutive_free_ports
from tests.monitoring.prometheus_server import PrometheusServer, fast_rules_copy

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "skewserve-training.json"


# Training expressions that stay empty on this run, each for a stated reason.
EMPTY_HERE = {
    "SkewserveTrainingGradNormNotFinite": "an alert's condition: false while gradients are finite",
    "GPU utilisation per rank [A]": "the trainer exports GPU utilisation only on CUDA",
}


def training_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    group = next(g for g in rules["groups"] if g["name"] == "skewserve-training")
    from_rules = [(r.get("record") or r["alert"], r["expr"]) for r in group["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    return from_rules + [
        (f"{p['title']} [{t['refId']}]", t["expr"]) for p in dash["panels"] for t in p["targets"]
    ]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from training.synth import SynthSpec, write

    work = tmp_path_factory.mktemp("train_metrics")
    data = work / "data"
    write(
        SynthSpec(
            n_classes=5,
            imbalance_ratio=20,
            n_max=3000,
            n_features=8,
            n_informative=6,
            n_val_per_class=20,
            n_test_per_class=20,
            seed=3,
        ),
        data,
    )
    base = consecutive_free_ports(["127.0.0.1"], 2)[0]
    log = (work / "train.log").open("wb")
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "skewserve",
            "train",
            "--data",
            str(data),
            "--out",
            str(work / "art"),
            "--nproc",
            "2",
            "--epochs",
            "500",
            "--patience",
            "0",
            "--batch-size",
            "64",
            "--width",
            "32",
            "--no-speed-balance",
            "--slow-rank",
            "1",
            "--slow-factor",
            "3",
            "--metrics-port",
            str(base),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # torchrun and its ranks in one process group, ended together below
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    log.close()
    prom = PrometheusServer(
        work / "prom",
        {"skewserve-training": [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]},
        [fast_rules_copy(RULES, work / "rules.fast.yml")],
    )
    try:
        prom.start()
        prom.wait_for(
            lambda: run.poll() is None and len(prom.query("skewserve:train_samples_per_s:rate1m > 0")) == 2,
            120,
            f"both ranks' throughput in Prometheus (training log: {work / 'train.log'})",
        )
        yield {"prom": prom, "run": run, "log": work / "train.log"}
    finally:
        prom.stop()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGTERM)
            try:
                run.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait(10)


@pytest.mark.parametrize("name,expr", training_expressions())
def test_every_training_rule_and_panel_evaluates(live_run: dict[str, Any], name: str, expr: str) -> None:
    """It runs, and returns samples from the live run unless EMPTY_HERE says why it cannot."""
    prom: PrometheusServer = live_run["prom"]
    prom.query(expr)
    if name in EMPTY_HERE:
        return
    prom.wait_for(lambda: bool(prom.query(expr)), 60, f"{name} to return samples")


@pytest.mark.parametrize(
    "expr",
    [
        "skewserve:train_samples_per_s:rate1m",
        "skewserve:train_busy_s_per_step:rate1m",
        "skewserve:train_data_wait_fraction:rate1m",
        "skewserve:train_allreduce_wait_fraction:rate1m",
        "skewserve_train_grad_norm",
        "skewserve_train_epoch",
    ],
)
def test_each_rank_reports_live(live_run: dict[str, Any], expr: str) -> None:
    prom: PrometheusServer = live_run["prom"]

    def per_rank() -> set[str]:
        return {s["metric"]["rank"] for s in prom.query(expr) if math.isfinite(float(s["value"][1]))}

    prom.wait_for(lambda: per_rank() == {"0", "1"}, 60, f"{expr} for ranks 0 and 1")
    assert live_run["run"].poll() is None, "the run ended: these were not live metrics"


def test_lasting_rank_imbalance_fires_the_alert_while_the_run_is_live(live_run: dict[str, Any]) -> None:
    prom: PrometheusServer = live_run["prom"]
    prom.wait_for(
        lambda: any(float(s["value"][1]) > 1.2 for s in prom.query("skewserve:train_rank_imbalance:rate1m")),
        60,
        "the live imbalance ratio above 1.2 (rank 1 is 3x slower)",
    )
    # The slow rank is the busy one: the fast rank waits for it in the all-reduce.
    busy = {
        s["metric"]["rank"]: float(s["value"][1])
        for s in prom.query("skewserve:train_busy_s_per_step:rate1m")
    }
    assert busy["1"] > busy["0"]
    prom.wait_for(lambda: prom.firing("SkewserveTrainingRankImbalance"), 60, "SkewserveTrainingRankImbalance")
    assert live_run["run"].poll() is None, live_run["log"].read_text()[-2000:]
