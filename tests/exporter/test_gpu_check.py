"""`make gpu-check` on a machine without a GPU, and the parts of its script that need none."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tomllib
import typer

from exporter.target import TARGET
from skewserve.commands.main import app

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module while the class is built
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_make_gpu_check_says_so_and_runs_nothing() -> None:
    res = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode != 0
    first = res.stderr.splitlines()[0]
    assert first.startswith("gpu-check: no usable CUDA GPU here: ") and first.endswith("Nothing ran.")
    assert "Error 3" in res.stderr  # the script's "no GPU" status, passed through make
    direct = subprocess.run(
        [sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert direct.returncode == 3 and direct.stdout == ""


def test_cuda_problem_names_the_cause() -> None:
    gpu = _script()
    cpu_build = SimpleNamespace(__version__="2.13.0+cpu", version=SimpleNamespace(cuda=None))
    assert "is a CPU build (torch.version.cuda is None)" in gpu.cuda_problem(cpu_build)
    hidden = SimpleNamespace(
        __version__="2.13.0",
        version=SimpleNamespace(cuda="12.6"),
        cuda=SimpleNamespace(is_available=lambda: False),
    )
    assert gpu.cuda_problem(hidden) == (
        "no CUDA GPU visible to torch 2.13.0 (CUDA 12.6); check nvidia-smi and CUDA_VISIBLE_DEVICES"
    )
    ready = SimpleNamespace(
        __version__="2.13.0",
        version=SimpleNamespace(cuda="12.6"),
        cuda=SimpleNamespace(is_available=lambda: True),
    )
    assert (
        gpu.cuda_problem(ready) is None
        and gpu.cuda_problem(None) == "torch is not installed in this interpreter"
    )


def test_prerequisites_onnxruntime_alternatives_and_the_pinned_tensorrt() -> None:
    gpu = _script()
    assert "overwrite each other's files" in gpu.onnxruntime_problem(
        {"onnxruntime", "onnxruntime-gpu"}, ["CUDAExecutionProvider"]
    )
    assert "pip uninstall -y onnxruntime && pip install onnxruntime-gpu" in gpu.onnxruntime_problem(
        {"onnxruntime"}, ["CPUExecutionProvider"]
    )
    assert (
        gpu.onnxruntime_problem({"onnxruntime-gpu"}, ["CUDAExecutionProvider", "CPUExecutionProvider"])
        is None
    )
    assert gpu.tensorrt_problem("10.5.0", TARGET.tensorrt_version) is None
    assert "runs TensorRT 10.5.0.18" in gpu.tensorrt_problem("10.7.0", "10.5.0.18")
    assert "not installed" in gpu.tensorrt_problem(None, TARGET.tensorrt_version)


def test_the_commands_it_runs_exist_with_those_options(tmp_path: Path) -> None:
    gpu = _script()
    group: Any = typer.main.get_command(app)
    for args in (
        gpu.train_args(tmp_path, tmp_path / "o", "bf16"),
        gpu.plan_args(tmp_path, tmp_path, "m", "fp32"),
        gpu.torchscript_args(tmp_path, tmp_path, "ts"),
        gpu.cnn_args(tmp_path, tmp_path / "c"),
    ):
        command = group.commands[args[0]]
        known = {opt for p in command.params for opt in p.opts}
        assert [a for a in args[1:] if a.startswith("--") and a not in known] == []
        ctx = command.make_context(args[0], list(args[1:]), resilient_parsing=True)
        assert ctx.params  # parses as given


def test_render_table_lines_up_figures() -> None:
    gpu = _script()
    steps = [
        gpu.Step("train cuda fp16", True, 12.34, {"gpu": "H100", "steps": 400}),
        gpu.Step("tests", False, 1.0, detail="boom"),
    ]
    assert gpu.render_table(steps).splitlines() == [
        "step             result  seconds  figures",
        "train cuda fp16  ok         12.3  gpu=H100, steps=400",
        "tests            FAIL        1.0    [boom]",
    ]


def test_gpu_extra_pins_the_serving_tensorrt_and_never_onnxruntime_gpu() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wheel_version = ".".join(TARGET.tensorrt_version.split(".")[:3])
    assert extras["gpu"] == [f"tensorrt-cu12=={wheel_version}"]
    every = [req for reqs in extras.values() for req in reqs]
    assert not [r for r in every if r.startswith("onnxruntime-gpu")]


def test_a_session_that_fell_back_to_the_cpu_is_refused() -> None:
    """make gpu-check asserts the provider a session actually runs on (exporter/parity.py)."""
    from exporter.parity import onnxruntime_runner, require_provider

    require_provider(["CUDAExecutionProvider", "CPUExecutionProvider"], "CUDAExecutionProvider")
    with pytest.raises(
        RuntimeError, match=r"runs this session on CPUExecutionProvider, not CUDAExecutionProvider"
    ):
        require_provider(["CPUExecutionProvider"], "CUDAExecutionProvider")
    # the CPU runner passes its own check on a real session
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    run = onnxruntime_runner(model.SerializeToString())
    assert list(run([np.ones(1, np.float32)])["y"]) == [1.0]
