"""Artifacts from before models were plug-ins (format 1) still export, to the same served model;
a user's factory whose module changed since training is named in a warning at export."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from exporter.pipeline import export_artifact
from training.config import TrainConfig
from training.launch import train


def _as_format_1(artifact: Path, out: Path) -> Path:
    """The artifact's metadata as format 1 wrote it (the tabular MLP only)."""
    shutil.copytree(artifact, out)
    meta = json.loads((out / "metadata.json").read_text())
    pre = meta["preprocessing"]
    old = {k: v for k, v in meta.items() if k not in ("model", "data_kind", "inputs", "preprocessing")}
    old |= {
        "format_version": 1,
        "model": {"hyperparameters": {k: meta["model"]["args"][k] for k in ("width", "depth", "dropout")}},
        "inputs": [{"name": n, "dtype": "float32"} for n in pre["feature_names"]],
        "normalisation": {"mean": pre["mean"], "std": pre["std"]},
    }
    (out / "metadata.json").write_text(json.dumps(old))
    return out


def _onnx_answers(version_dir: Path, rows: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(str(version_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: rows})  # type: ignore[no-any-return]


def test_a_format_1_artifact_exports_to_the_same_served_model(small_artifact: Path, tmp_path: Path) -> None:
    old = _as_format_1(small_artifact, tmp_path / "old")
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "now", tensorrt="off")
    export_artifact(old, repo, "then", tensorrt="off")
    rows = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32) * 20
    for got, want in zip(
        _onnx_answers(repo / "then" / "1", rows), _onnx_answers(repo / "now" / "1", rows), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    then_config = (repo / "then" / "config.pbtxt").read_text()
    assert then_config.replace('"then"', '"now"') == (repo / "now" / "config.pbtxt").read_text()


FACTORY = """
from torch import nn


def build(data, width=8):
    n_in = data.inputs[0].shape[0]
    return nn.Sequential(nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, len(data.classes)))
"""


def test_export_warns_when_the_factorys_module_changed_since_training(
    small_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = tmp_path / "my_net.py"
    module.write_text(FACTORY)
    art = tmp_path / "art"
    train(TrainConfig(data_dir=small_data, out_dir=art, model=f"{module}:build", max_steps=2, progress=False))
    trained = json.loads((art / "metadata.json").read_text())["model"]["sha256"]
    with caplog.at_level(logging.WARNING, logger="training.artifact"):
        export_artifact(art, tmp_path / "repo", "mine", tensorrt="off")
    assert not [r for r in caplog.records if "changed since training" in r.getMessage()]
    module.write_text(FACTORY + "\n# a comment: the file is not the one trained\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training.artifact"):
        export_artifact(art, tmp_path / "repo", "mine", tensorrt="off")
    warned = [r.getMessage() for r in caplog.records if "changed since training" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"model factory {module}:build: its module file changed")
    assert f"(sha256 {trained[:12]}, now " in warned[0]
