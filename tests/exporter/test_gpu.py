"""What only a CUDA GPU can show: TensorRT plans, TorchScript and ONNX Runtime on CUDA, against PyTorch.

Run by `make gpu-check` (scripts/gpu_check.py) on a CUDA machine with the gpu extra; skipped, with
the reason, where torch sees no CUDA GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter.graph import ServingModule
from exporter.parity import (
    TF32_TOLERANCE,
    TOLERANCE,
    compare,
    onnxruntime_runner,
    require,
    torch_runner,
    torchscript_runner,
    validation_batches,
)
from exporter.pipeline import export_artifact
from repository.model_config import parse
from training.artifact import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]


def _card(result_path: Path) -> dict:
    return json.loads((result_path / "model_card.json").read_text())


def _capability() -> str:
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def test_fp32_plan_is_built_with_tf32_off_and_matches_pytorch(small_artifact: Path, tmp_path: Path) -> None:
    import tensorrt as trt

    result = export_artifact(small_artifact, tmp_path, "m", tensorrt="on")
    plan_report = result.parity[-1]
    assert plan_report.target == "tensorrt model.plan" and plan_report.tolerance == TOLERANCE["fp32"]
    assert plan_report.max_abs_error_probabilities <= 1e-4
    record = _card(result.published.path)["export"]["tensorrt"]
    assert record["version"] == trt.__version__ and record["tf32"] is False
    assert record["plans"] == [
        {"file": "model.plan", "gpu": torch.cuda.get_device_name(0), "compute_capability": _capability()}
    ]
    cfg = parse((tmp_path / "m" / "config.pbtxt").read_text())
    assert cfg.platform == "tensorrt_plan" and cfg.default_model_filename == "model.plan"
    assert (tmp_path / "m" / "serving_backend.json").read_text().count("tensorrt") == 1


def test_fp16_plan_matches_pytorch_within_the_fp16_limit(small_artifact: Path, tmp_path: Path) -> None:
    result = export_artifact(small_artifact, tmp_path, "m", precision="fp16", tensorrt="on")
    assert result.parity[-1].tolerance == TOLERANCE["fp16"] and result.parity[-1].passed
    assert _card(result.published.path)["canary"]["gpu_tolerance"] == TOLERANCE["fp16"]


def test_version_and_hardware_compatible_plans_build_and_run(small_artifact: Path, tmp_path: Path) -> None:
    from exporter.tensorrt_build import TensorRTOptions

    ampere = torch.cuda.get_device_capability(0) >= (8, 0)
    opts = TensorRTOptions(
        version_compatible=True, hardware_compatibility="ampere_plus" if ampere else "none"
    )
    result = export_artifact(small_artifact, tmp_path, "m", tensorrt="on", trt_options=opts)
    assert result.parity[-1].passed
    record = _card(result.published.path)["export"]["tensorrt"]
    assert record["version_compatible"] is True
    assert record["hardware_compatibility"] == ("ampere_plus" if ampere else "none")


def test_torchscript_on_cuda_matches_pytorch(small_artifact: Path, tmp_path: Path) -> None:
    result = export_artifact(small_artifact, tmp_path, "ts", fmt="torchscript")
    model, meta = load_model(small_artifact)
    reference = torch_runner(ServingModule(model))
    on_cuda = torchscript_runner(str(result.published.path / "model.pt"), device="cuda")
    report = require(compare(reference, on_cuda, validation_batches(meta, 64), "torchscript cuda", "fp32"))
    assert report.max_abs_error_probabilities <= TOLERANCE["fp32"]


def test_onnxruntime_cuda_provider_matches_pytorch_within_the_tf32_limit(
    small_artifact: Path, tmp_path: Path
) -> None:
    result = export_artifact(small_artifact, tmp_path, "m", tensorrt="off")
    model, meta = load_model(small_artifact)
    reference = torch_runner(ServingModule(model))
    ort_cuda = onnxruntime_runner(
        (result.published.path / "model.onnx").read_bytes(), "CUDAExecutionProvider"
    )
    rows = validation_batches(meta, 64)
    report = require(compare(reference, ort_cuda, rows, "onnxruntime cuda", "fp32", TF32_TOLERANCE))
    assert np.isfinite(report.max_abs_error_probabilities)
