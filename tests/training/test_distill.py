"""Distillation (issue 35 item 3): a student learns the teacher's balanced decision; a teacher that
does not fit the data is refused by name. Real in-process training runs on long-tailed tables."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from training.artifact import load_model
from training.config import TrainConfig
from training.data_source import open_data
from training.datasets import SplitDataset
from training.distill import artifact_digest
from training.errors import ConfigError
from training.launch import train
from training.synth import SynthSpec, write


def _labels(artifact: Path, data_dir: Path) -> np.ndarray:
    """The model's labels on the validation and test splits of `data_dir`, in order."""
    model, _ = load_model(artifact)
    data = open_data(str(data_dir), "label")
    out = []
    for split in (data.val, data.test):
        assert split is not None
        inputs, _ = SplitDataset(split, data.spec).__getitems__(list(range(len(split))))
        with torch.no_grad():
            out.append(model(*inputs).argmax(dim=1).numpy())
    return np.concatenate(out)


@pytest.fixture(scope="module")
def cloud_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cloud model: wider, trained on the same classes and features with 4x the rows."""
    big = tmp_path_factory.mktemp("big_data")
    write(
        SynthSpec(
            n_classes=5, imbalance_ratio=20, n_max=1600, n_features=8, n_informative=6,
            n_val_per_class=40, n_test_per_class=40, seed=2,
        ),
        big,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("teacher") / "cloud"
    train(TrainConfig(data_dir=big, out_dir=out, epochs=12, width=64, progress=False))
    return out


def test_the_distilled_student_agrees_with_the_teacher_more(
    cloud_teacher: Path, small_data: Path, tmp_path: Path
) -> None:
    student = dict(width=16, depth=1, epochs=30, lr=0.01, input_noise=0.0, progress=False)
    train(TrainConfig(data_dir=small_data, out_dir=tmp_path / "plain", **student))  # type: ignore[arg-type]
    meta = train(
        TrainConfig(data_dir=small_data, out_dir=tmp_path / "kd", distill_from=cloud_teacher, **student)  # type: ignore[arg-type]
    )
    teacher = _labels(cloud_teacher, small_data)
    plain = float((_labels(tmp_path / "plain", small_data) == teacher).mean())
    distilled = float((_labels(tmp_path / "kd", small_data) == teacher).mean())
    print(f"agreement with the teacher: plain {plain:.4f}, distilled {distilled:.4f}")
    assert distilled >= plain + 0.02, (plain, distilled)
    record = meta["provenance"]["distillation"]
    assert record["teacher"]["path"] == str(cloud_teacher.resolve())
    assert record["teacher"]["sha256"] == artifact_digest(cloud_teacher)
    assert record["teacher"]["model"] == "mlp" and record["teacher"]["loss"] == "logit_adjusted"
    # Its loss already balanced the teacher's logits: no second adjustment.
    assert record["teacher"]["adjustment_tau"] == 0.0
    assert (record["weight"], record["temperature"]) == (0.5, 1.0)


def test_a_teacher_of_other_classes_is_refused_by_name(
    small_artifact: Path, small_data: Path, tmp_path: Path
) -> None:
    teacher = tmp_path / "other"
    shutil.copytree(small_artifact, teacher, ignore=shutil.ignore_patterns("checkpoints"))
    meta = json.loads((teacher / "metadata.json").read_text())
    meta["classes"] = [*meta["classes"][:4], "class_99"]
    meta["inputs"][0]["shape"] = [9]
    (teacher / "metadata.json").write_text(json.dumps(meta))
    cfg = TrainConfig(
        data_dir=small_data, out_dir=tmp_path / "s", epochs=1, distill_from=teacher, progress=False
    )
    with pytest.raises(
        ConfigError, match=rf"--distill-from {teacher}: the teacher does not fit this data"
    ) as err:
        train(cfg)
    assert "classes: teacher [" in str(err.value) and "'class_99'" in str(err.value)
    assert "inputs: teacher [{'name': 'features', 'dtype': 'float32', 'shape': [9]}]" in str(err.value)
    assert not (tmp_path / "s" / "metadata.json").exists()


def test_distillation_settings_without_a_teacher_are_refused(small_data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="take effect only with distill_from; pass --distill-from"):
        TrainConfig(data_dir=small_data, out_dir=tmp_path, distill_weight=0.8)


def test_resume_refuses_a_changed_teacher_setting(
    small_artifact: Path, small_data: Path, tmp_path: Path
) -> None:
    base = dict(
        data_dir=small_data, out_dir=tmp_path / "r", epochs=1, distill_from=small_artifact, progress=False
    )
    train(TrainConfig(**base))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="distill_temperature: checkpoint 1.0 vs now 3.0"):
        train(TrainConfig(**base, distill_temperature=3.0, resume=True))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="distill_from: checkpoint .* vs now None"):
        train(TrainConfig(data_dir=small_data, out_dir=tmp_path / "r", epochs=1, resume=True, progress=False))
