"""`skewserve cascade calibrate` (issue 35 item 2): the rule file it writes, the targets it meets on
the validation split, and its refusal of a split that lacks a class. The deferral rule itself (its
file, its digest, its verdicts) is the gateway's: gateway/fleet/cascade_rule.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gateway.fleet.cascade_rule import (
    NEVER_KEEP,
    DeferralRule,
    RuleError,
    read_rule,
    rule_document,
    write_rule,
)
from skewserve.cascade_calibrate import (
    Outputs,
    Target,
    figures,
    global_threshold,
    load_outputs,
    per_class_thresholds,
)

SKEWSERVE = [sys.executable, "-m", "skewserve"]


@pytest.fixture(scope="module")
def edge_artifact(small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.config import TrainConfig
    from training.launch import train

    out = tmp_path_factory.mktemp("edge") / "edge"
    train(TrainConfig(data_dir=small_data, out_dir=out, epochs=1, width=8, progress=False))
    return out


def _calibrate(
    edge: Path, cloud: Path, data: Path, target: str, out: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *SKEWSERVE,
            "cascade",
            "calibrate",
            "--edge",
            str(edge),
            "--cloud",
            str(cloud),
            "--data",
            str(data),
            "--target",
            target,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_calibrate_meets_its_target_and_writes_a_versioned_rule(
    edge_artifact: Path, small_artifact: Path, small_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rule.json"
    res = _calibrate(edge_artifact, small_artifact, small_data, "within=0.02", out)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    rule = read_rule(out)  # whole: its digest matches its decision fields
    assert (rule.version, rule.kind, doc["target"]) == (1, "per_class", {"kind": "within", "value": 0.02})
    val = doc["validation"]
    assert val["cascade"]["balanced_accuracy"] >= val["cloud"]["balanced_accuracy"] - 0.02 - 1e-9
    assert val["temperature"]["nll_after"] <= val["temperature"]["nll_before"] + 1e-9
    assert "baseline_global" in val and val["items"] == 200
    # The figures are the gateway's rule applied to both models' outputs on the validation split.
    outputs = load_outputs(edge_artifact, small_artifact, small_data)
    assert figures(outputs, rule) == val["cascade"]
    # Same decision again: same version; another target: the next version.
    assert _calibrate(edge_artifact, small_artifact, small_data, "within=0.02", out).returncode == 0
    assert read_rule(out).version == 1
    res = _calibrate(edge_artifact, small_artifact, small_data, "escalation=0.3", out)
    assert res.returncode == 0, res.stdout + res.stderr
    budget = json.loads(out.read_text())
    assert read_rule(out).version == 2
    assert budget["validation"]["cascade"]["escalation_rate"] <= 0.3


@pytest.mark.slow
def test_calibrate_refuses_a_validation_split_without_every_class(
    edge_artifact: Path, small_artifact: Path, small_data: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    val = pd.read_parquet(data / "val.parquet")
    val[~val["label"].isin(["class_01", "class_03"])].to_parquet(data / "val.parquet")
    res = _calibrate(edge_artifact, small_artifact, data, "within=0.01", tmp_path / "rule.json")
    assert res.returncode == 2, res.stdout + res.stderr
    assert (
        f"the validation split of {data} has no items of classes ['class_01', 'class_03'] (2 of 5)"
        in " ".join(res.stdout.split())
    )
    assert not (tmp_path / "rule.json").exists()


def test_per_class_thresholds_escalate_a_rare_class_the_edge_is_confidently_wrong_on() -> None:
    """Head class 0 (90 items): the edge says 0, right, at 0.95 for 80 of them. Rare class 1 (10
    items): the edge says 1 at 0.96 for 10 items of class 0 and 5 of class 1, and 0 at 0.7 for the
    other 5. The cloud is always right. Within 0.05 of the cloud's balanced accuracy, the per-class
    rule keeps the head's answers and escalates every "rare"; the global threshold must pass the
    surest answers first, the wrong "rare" ones, so it keeps nothing."""
    labels = np.array([0] * 90 + [1] * 10)
    predicted = np.array([0] * 80 + [1] * 10 + [1] * 5 + [0] * 5)
    sure = np.array([0.95] * 80 + [0.96] * 15 + [0.7] * 5)
    edge = np.stack([np.where(predicted == 0, sure, 1 - sure), np.where(predicted == 1, sure, 1 - sure)], 1)
    cloud = np.eye(2)[labels] * 0.9 + 0.05
    out = Outputs(edge, cloud, labels, ["head", "rare"])
    target = Target("within", 0.05)
    assert per_class_thresholds(out, 1.0, target) == [pytest.approx(0.95), NEVER_KEEP]
    assert global_threshold(out, 1.0, target) == NEVER_KEEP


def test_a_rule_file_edited_by_hand_is_refused_naming_it(tmp_path: Path) -> None:
    path = write_rule(tmp_path / "rule.json", rule_document("global", ["a", "b"], 1.5, [0.7, 0.7], 3))
    assert read_rule(path).tag.startswith("3-")
    doc = json.loads(path.read_text())
    doc["thresholds"] = [0.1, 0.1]
    path.write_text(json.dumps(doc))
    with pytest.raises(
        RuleError, match=r"rule.json: digest [0-9a-f]{16}\.\.\. does not match its decision fields"
    ):
        read_rule(path)


def test_a_verdict_on_a_batch_keeps_it_only_when_every_row_passes() -> None:
    doc = rule_document("per_class", ["a", "b"], 1.0, [0.6, 0.9], 1)
    rule = DeferralRule("per_class", "probabilities", ("a", "b"), 1.0, (0.6, 0.9), 1, doc["digest"])
    p = np.array([[0.7, 0.3], [0.2, 0.8]])  # row 0 passes (0.7 >= 0.6), row 1 does not (0.8 < 0.9)
    assert rule.keeps(p).tolist() == [True, False]
    verdict = rule.judge(p)
    assert verdict is not None and not verdict.keep and verdict.score == pytest.approx(0.8)
    assert rule.judge(p[:1]).keep  # type: ignore[union-attr]
    assert rule.judge(np.ones((1, 3)) / 3) is None  # not one column per class: cannot be judged
