"""`--format torchscript`: a pytorch_libtorch model, served here by a real tritonserver (local profile)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from exporter.errors import ExportError, ParityError
from exporter.graph import ServingModule
from exporter.parity import compare, require, torch_runner, torchscript_runner
from exporter.pipeline import export_artifact
from repository.model_config import parse
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from training.artifact import load_model


def test_torchscript_version_served_by_tritonserver_equals_pytorch(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    result = export_artifact(small_artifact, repo, "ts", fmt="torchscript")
    assert [(r.target, r.precision, r.passed) for r in result.parity] == [("torchscript", "fp32", True)]
    assert result.parity[0].max_abs_error_probabilities <= 1e-4
    version_dir = result.published.path
    assert sorted(p.name for p in version_dir.iterdir()) == [
        ".skewserve-configs",  # the model-level files this version was published with
        "batching.py",
        "model.pt",
        "model.py",
        "model_card.json",
    ]
    gpu = parse((repo / "ts" / "config.pbtxt").read_text())
    assert gpu.platform == "pytorch_libtorch" and gpu.default_model_filename == "model.pt"
    card = json.loads((version_dir / "model_card.json").read_text())
    assert card["export"]["tensorrt"] is None and card["canary"]["gpu_tolerance"] == 1e-4

    model, _ = load_model(small_artifact)
    x = (np.random.default_rng(3).standard_normal((6, 8)) * 10).astype(np.float32)
    with torch.no_grad():
        logits, probs, label = ServingModule(model)(torch.from_numpy(x))
    server = TritonServer(TritonServerSpec(repository=repo, name="ts"), tmp_path / "logs", prepared_triton)
    with server:
        h = httpclient.InferenceServerClient(server.http_address)
        assert h.get_model_config("ts")["backend"] == "python"  # local profile: torch in the Python backend
        inp = httpclient.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = h.infer("ts", [inp])
        np.testing.assert_allclose(out.as_numpy("probabilities"), probs.numpy(), atol=1e-5)
        np.testing.assert_allclose(out.as_numpy("logits"), logits.numpy(), atol=1e-4, rtol=1e-5)
        np.testing.assert_array_equal(out.as_numpy("label"), label.numpy())
        g = grpcclient.InferenceServerClient(server.grpc_address)
        ginp = grpcclient.InferInput("features", [1, 8], "FP32")
        ginp.set_data_from_numpy(x[:1])
        np.testing.assert_allclose(
            g.infer("ts", [ginp]).as_numpy("probabilities"), probs.numpy()[:1], atol=1e-5
        )


def test_torchscript_parity_gate_refuses_a_module_that_differs(small_artifact: Path, tmp_path: Path) -> None:
    """The gate runs the saved file: a model.pt whose weights moved fails with the figures."""
    model, _ = load_model(small_artifact)
    module = ServingModule(model)
    path = tmp_path / "model.pt"
    torch.jit.trace(module, (torch.zeros(2, 8),)).save(str(path))
    reference = torch_runner(module)
    rows = [(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32),)]
    assert require(compare(reference, torchscript_runner(str(path)), rows, "torchscript", "fp32")).passed
    skewed = torch.jit.load(str(path))
    with torch.no_grad():
        for p in skewed.parameters():
            p.add_(0.05)
    skewed.save(str(path))
    with pytest.raises(
        ParityError, match=r"refusing to publish: parity failed for torchscript fp32: max \|Δp\|"
    ):
        require(compare(reference, torchscript_runner(str(path)), rows, "torchscript", "fp32"))


def test_torchscript_with_tensorrt_on_is_refused(small_artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="--tensorrt on builds a plan from ONNX; use --format onnx"):
        export_artifact(small_artifact, tmp_path, "ts", fmt="torchscript", tensorrt="on")
