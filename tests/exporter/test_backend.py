"""A model's serving backend is kept per model: real publishes of ONNX and TorchScript versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.pipeline import export_artifact
from exporter.triton_config import ConfigOptions
from repository.backend import BACKEND_FILE, recorded_backend
from repository.disk import published_versions
from repository.errors import PublishError
from repository.model_config import parse


def _leftovers(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir() if p.name.startswith(".tmp-"))


def test_backend_change_is_explicit_and_refused_while_live_versions_need_the_old_one(
    small_artifact: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "m"
    export_artifact(small_artifact, tmp_path, "m", tensorrt="off")
    assert recorded_backend(model_dir) == "onnxruntime"
    assert json.loads((model_dir / BACKEND_FILE).read_text()) == {"backend": "onnxruntime"}

    # a TorchScript version would make Triton load 1/model.pt, which version 1 does not have
    with pytest.raises(
        PublishError,
        match=r"^m is served with the onnxruntime backend \(serving_backend.json\); this export would switch "
        r"it to pytorch for every version\. .* or pass --change-backend$",
    ):
        export_artifact(small_artifact, tmp_path, "m", fmt="torchscript")
    assert published_versions(model_dir) == [1] and _leftovers(model_dir) == []
    assert parse((model_dir / "config.pbtxt").read_text()).backend == "onnxruntime"

    # asked for, but version 1 stays live (its desired state serves it) and has no model.pt; what
    # the new config keeps does not matter: publishing never changes what is served
    for options in (ConfigOptions(), ConfigOptions(keep_versions=1)):
        with pytest.raises(
            PublishError,
            match=r"^cannot switch m from onnxruntime to pytorch: versions \[1\] stay live \(the model's desired "
            r"state serves them\) and still need onnxruntime \(version 1 has no model.pt\)",
        ):
            export_artifact(
                small_artifact, tmp_path, "m", fmt="torchscript", change_backend=True, options=options
            )
    assert published_versions(model_dir) == [1] and recorded_backend(model_dir) == "onnxruntime"
    assert parse((model_dir / "config.pbtxt").read_text()).backend == "onnxruntime"


def test_auto_follows_the_recorded_backend_not_the_host(small_artifact: Path, tmp_path: Path) -> None:
    """`--tensorrt auto` on a model recorded as onnxruntime never builds a plan, whatever the host has."""
    export_artifact(small_artifact, tmp_path, "m", tensorrt="off")
    second = export_artifact(small_artifact, tmp_path, "m", tensorrt="auto")
    assert not second.tensorrt and not (second.published.path / "model.plan").exists()
    assert parse((tmp_path / "m" / "config.pbtxt").read_text()).backend == "onnxruntime"


def test_recorded_tensorrt_backend_without_a_gpu_is_a_clear_error(
    small_artifact: Path, tmp_path: Path
) -> None:
    """Run on every host: the export runs with the GPU hidden (CUDA_VISIBLE_DEVICES empty), as on a
    CPU-only host, so a machine with a GPU tests this path too."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / BACKEND_FILE).write_text(json.dumps({"backend": "tensorrt"}))
    cmd = [sys.executable, "-m", "skewserve", "export", "--artifact", str(small_artifact)]
    cmd += ["--repo", str(tmp_path), "--name", "m", "--tensorrt", "auto"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 1, res.stdout + res.stderr
    assert (
        "error: the model serves TensorRT plans (serving_backend.json), but this host cannot build one: "
        "no CUDA GPU on this machine. Export on a GPU host with the gpu extra, or pass --tensorrt off "
        "--change-backend" in " ".join(res.stdout.split())
    ), res.stdout + res.stderr
    assert published_versions(tmp_path / "m") == []


def test_cli_export_options(small_artifact: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "skewserve", "export", "--artifact", str(small_artifact)]
    base += ["--repo", str(tmp_path), "--name", "m"]
    res = subprocess.run([*base, "--ort-tensorrt", "int4"], capture_output=True, text=True)
    assert res.returncode == 2 and "ort_tensorrt" in res.stdout + res.stderr
    res = subprocess.run(
        [*base, "--format", "torchscript", "--precision", "fp16"], capture_output=True, text=True
    )
    assert res.returncode == 1 and "--format torchscript exports FP32 only" in res.stdout
    res = subprocess.run(
        [*base, "--tensorrt", "off", "--ort-tensorrt", "fp16", "--response-cache", "--keep-versions", "3"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    gpu = parse((tmp_path / "m" / "config.pbtxt").read_text())
    acc = gpu.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert acc.name == "tensorrt" and acc.parameters["precision_mode"] == "FP16"
    # served versions come from desired state (the first version): --keep-versions no longer applies
    assert list(gpu.version_policy.specific.versions) == [1] and gpu.response_cache.enable
    card = json.loads((tmp_path / "m" / "1" / "model_card.json").read_text())
    assert card["canary"]["gpu_tolerance"] == 1e-2  # FP16 accelerator on GPU servers
    res = subprocess.run([*base, "--format", "torchscript"], capture_output=True, text=True)
    assert res.returncode == 1 and "pass --change-backend" in res.stdout
