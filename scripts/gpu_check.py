"""`make gpu-check`: everything only a CUDA GPU can show, in one run of a few minutes, with its figures.

Steps: CUDA training on one rank in bf16 and fp16 (`skewserve train`), TensorRT FP32 and FP16 plans
with parity against PyTorch (`skewserve export --tensorrt on`), TorchScript on CUDA, the ONNX
Runtime CUDA provider, then every test marked `gpu`. Each step is a real child process with its own
time limit, so the whole check stays under 8 minutes; the figures are printed as one table at the end.

Exit status: 0 all steps passed; 1 a step failed; 3 no usable CUDA GPU here (nothing ran: the message
says why); 4 a prerequisite is missing (the message says what to install). Run it with an interpreter
whose torch is a CUDA build and which has the `gpu` extra (README, "GPU check"):
`make gpu-check GPU_PYTHON=.venv-gpu/bin/python`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = 3
MISSING = 4
TOTAL_BUDGET_S = 480.0  # the bound: under 8 minutes on one GPU


@dataclass
class Step:
    name: str
    ok: bool
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


def cuda_problem(torch_module: Any) -> str | None:
    """None when torch can run on a CUDA GPU here; otherwise why not, in one line."""
    if torch_module is None:
        return "torch is not installed in this interpreter"
    if getattr(torch_module.version, "cuda", None) is None:
        return (
            f"torch {torch_module.__version__} here is a CPU build (torch.version.cuda is None); run with an "
            "interpreter that has a CUDA build of torch: make gpu-check GPU_PYTHON=/path/to/python"
        )
    if not torch_module.cuda.is_available():
        return (
            f"no CUDA GPU visible to torch {torch_module.__version__} (CUDA {torch_module.version.cuda}); "
            "check nvidia-smi and CUDA_VISIBLE_DEVICES"
        )
    return None


def onnxruntime_problem(distributions: set[str], providers: list[str]) -> str | None:
    """The ONNX Runtime CUDA provider needs onnxruntime-gpu *instead of* onnxruntime (same files)."""
    both = {"onnxruntime", "onnxruntime-gpu"} <= distributions
    if both:
        return (
            "both onnxruntime and onnxruntime-gpu are installed; they overwrite each other's files: "
            "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu"
        )
    if "CUDAExecutionProvider" not in providers:
        return (
            f"ONNX Runtime here has no CUDAExecutionProvider (providers: {', '.join(providers) or 'none'}): "
            "pip uninstall -y onnxruntime && pip install onnxruntime-gpu"
        )
    return None


def tensorrt_problem(installed: str | None, target: str) -> str | None:
    if installed is None:
        return "the tensorrt package is not installed: pip install -e '.[gpu]' (pins the serving image's TensorRT)"
    if installed.split(".")[:3] != target.split(".")[:3]:
        return (
            f"tensorrt {installed} is installed but the serving image runs TensorRT {target}: "
            "pip install -e '.[gpu]' (plans must be built with the serving image's version)"
        )
    return None


def train_args(data: Path, out: Path, precision: str) -> list[str]:
    """One CUDA rank, a short fixed step budget: `skewserve train` as a person would run it."""
    return [
        "train", "--data", str(data), "--out", str(out), "--nproc", "1", "--device", "cuda",
        "--precision", precision, "--max-steps", "400",
    ]  # fmt: skip


def cnn_args(data: Path, out: Path) -> list[str]:
    """The cnn family on digits-LT image folders: AMP, DataLoader workers, pinned async copies."""
    return [
        "train", "--data", str(data), "--out", str(out), "--model", "cnn", "--nproc", "1",
        "--device", "cuda", "--max-steps", "300",
    ]  # fmt: skip


def plan_args(artifact: Path, repo: Path, name: str, precision: str) -> list[str]:
    return [
        "export", "--artifact", str(artifact), "--repo", str(repo), "--name", name,
        "--precision", precision, "--tensorrt", "on",
    ]  # fmt: skip


def torchscript_args(artifact: Path, repo: Path, name: str) -> list[str]:
    return [
        "export",
        "--artifact",
        str(artifact),
        "--repo",
        str(repo),
        "--name",
        name,
        "--format",
        "torchscript",
    ]


def _distributions() -> set[str]:
    return {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}


def render_table(steps: list[Step]) -> str:
    """The figures, one line per step, aligned for a terminal or a CI log."""
    width = max([len(s.name) for s in steps] + [4])
    lines = [f"{'step':<{width}}  result  seconds  figures"]
    for s in steps:
        figures = ", ".join(f"{k}={v}" for k, v in s.figures.items())
        detail = f"  [{s.detail}]" if s.detail else ""
        lines.append(f"{s.name:<{width}}  {'ok' if s.ok else 'FAIL':<6}  {s.seconds:7.1f}  {figures}{detail}")
    return "\n".join(lines)


def _run(cmd: list[str], timeout_s: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(10.0, timeout_s), check=False
    )


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


class Check:
    def __init__(self, work: Path, deadline: float) -> None:
        self.work = work
        self.deadline = deadline
        self.steps: list[Step] = []
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, body: Callable[[], dict[str, Any]]) -> None:
        started = time.monotonic()
        if self.left() <= 0:
            self.steps.append(Step(name, False, 0.0, detail="not run: the 8-minute budget is spent"))
            return
        try:
            figures = body()
            self.steps.append(Step(name, True, time.monotonic() - started, figures))
        except Exception as exc:  # every failure is recorded with its reason; the other steps still run
            self.steps.append(
                Step(name, False, time.monotonic() - started, detail=f"{type(exc).__name__}: {exc}")
            )
        print(render_table(self.steps[-1:]).splitlines()[1], flush=True)

    def cli(self, *args: str, limit_s: float) -> str:
        res = _run([sys.executable, "-m", "skewserve", *args], min(limit_s, self.left()), self.env)
        if res.returncode != 0:
            raise RuntimeError(
                f"skewserve {args[0]} exited {res.returncode}: {_tail(res.stdout + res.stderr)}"
            )
        return res.stdout


def run_check(work: Path) -> list[Step]:
    import torch

    from exporter.graph import ServingModule
    from exporter.parity import (
        TF32_TOLERANCE,
        compare,
        onnxruntime_runner,
        require,
        torch_runner,
        torchscript_runner,
        validation_batches,
    )
    from training.artifact import load_model
    from training.synth import SynthSpec, write

    check = Check(work, time.monotonic() + TOTAL_BUDGET_S)
    data = work / "data"
    write(SynthSpec(n_classes=6, imbalance_ratio=50, n_max=2000, n_features=12, seed=0), data)
    artifacts: dict[str, Path] = {}

    def train(precision: str) -> dict[str, Any]:
        out = work / f"artifact-{precision}"
        check.cli(*train_args(data, out, precision), limit_s=120)
        meta = json.loads((out / "metadata.json").read_text())
        prov = meta["provenance"]
        if prov.get("device") != "cuda" or prov.get("precision") != precision:
            raise RuntimeError(
                f"the run recorded device {prov.get('device')} precision {prov.get('precision')}"
            )
        artifacts[precision] = out
        metrics = meta["metrics"]
        split = "test" if "test" in metrics else "val"
        return {
            "gpu": prov.get("device_name"),
            "steps": prov.get("steps_run"),
            "mean_epoch_ms": round(1000 * float(prov.get("mean_epoch_wall_s", 0.0)), 1),
            f"{split}_balanced_acc": round(float(metrics[split]["balanced_accuracy"]), 3),
        }

    bf16 = torch.cuda.is_bf16_supported()
    if bf16:
        check.step("train cuda bf16 (1 rank)", lambda: train("bf16"))
    else:
        check.steps.append(
            Step("train cuda bf16 (1 rank)", True, 0.0, detail="GPU has no bf16: not applicable")
        )
    check.step("train cuda fp16 (1 rank)", lambda: train("fp16"))

    def cnn() -> dict[str, Any]:
        from training.datasets_builtin import write_digits_lt

        images, out = work / "digits", work / "artifact-cnn"
        write_digits_lt(images)
        check.cli(*cnn_args(images, out), limit_s=180)
        meta = json.loads((out / "metadata.json").read_text())
        epochs = [
            json.loads(x) for x in (out / "checkpoints" / "monitor-epochs.jsonl").read_text().splitlines()
        ]
        wait = sum(e["data_wait_s_per_step"][0] * e["steps"] for e in epochs)
        busy = sum(e["busy_s_per_step"][0] * e["steps"] for e in epochs)
        check.cli(*plan_args(out, work / "repo", "digits_trt", "fp16"), limit_s=180)
        return {
            "precision": meta["provenance"]["precision"],
            "test_balanced_acc": round(float(meta["metrics"]["test"]["balanced_accuracy"]), 3),
            "data_wait_share": f"{100 * wait / max(busy, 1e-9):.1f}%",
        }

    check.step("train cuda cnn on image folders + fp16 plan", cnn)
    artifact = artifacts.get("fp16") or artifacts.get("bf16")
    if artifact is None:
        return check.steps
    repo = work / "repo"

    def plan(precision: str) -> dict[str, Any]:
        name = f"trt_{precision}"
        check.cli(*plan_args(artifact, repo, name, precision), limit_s=180)
        card = json.loads((repo / name / "1" / "model_card.json").read_text())
        report = [r for r in card["parity"] if r["target"].startswith("tensorrt")][-1]
        record = card["export"]["tensorrt"]
        return {
            "max_dp": f"{report['max_abs_error_probabilities']:.1e}",
            "limit": f"{report['tolerance']:.0e}",
            "argmax_agree": f"{100 * report['argmax_agreement']:.2f}%",
            "tensorrt": record["version"],
            "cc": record["plans"][0]["compute_capability"],
        }

    check.step("tensorrt fp32 plan (TF32 off)", lambda: plan("fp32"))
    check.step("tensorrt fp16 plan", lambda: plan("fp16"))
    model, meta = load_model(artifact)
    reference = torch_runner(ServingModule(model))
    rows = validation_batches(meta, 64)

    def torchscript() -> dict[str, Any]:
        check.cli(*torchscript_args(artifact, repo, "ts"), limit_s=120)
        runner = torchscript_runner(str(repo / "ts" / "1" / "model.pt"), device="cuda")
        report = require(compare(reference, runner, rows, "torchscript cuda", "fp32"))
        return {"max_dp": f"{report.max_abs_error_probabilities:.1e}", "limit": f"{report.tolerance:.0e}"}

    def ort_cuda() -> dict[str, Any]:
        onnx_bytes = (repo / "trt_fp32" / "1" / "model.onnx").read_bytes()
        runner = onnxruntime_runner(onnx_bytes, "CUDAExecutionProvider")
        report = require(compare(reference, runner, rows, "onnxruntime cuda", "fp32", TF32_TOLERANCE))
        return {
            "max_dp": f"{report.max_abs_error_probabilities:.1e}",
            "limit": f"{report.tolerance:.0e} (TF32)",
        }

    check.step("torchscript on cuda", torchscript)
    check.step("onnxruntime CUDA provider", ort_cuda)

    def gpu_tests() -> dict[str, Any]:
        res = _run(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
            check.left(),
            check.env,
        )
        summary = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr.strip()[-200:]
        if res.returncode != 0:
            raise RuntimeError(f"pytest -m gpu exited {res.returncode}: {_tail(res.stdout, 12)}")
        if "skipped" in summary:
            raise RuntimeError(f"gpu tests were skipped on a GPU machine: {summary}")
        return {"pytest": summary}

    check.step("tests marked gpu", gpu_tests)
    return check.steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keep", type=Path, help="Work in this folder and keep it (default: a temporary one)."
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    problem = cuda_problem(torch)
    if problem is not None:
        print(f"gpu-check: no usable CUDA GPU here: {problem}. Nothing ran.", file=sys.stderr)
        return NO_GPU
    from exporter.target import TARGET

    try:
        import tensorrt

        trt_version: str | None = tensorrt.__version__
    except ImportError:
        trt_version = None
    try:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
    except ImportError:
        providers = []
    missing = [
        p
        for p in (
            tensorrt_problem(trt_version, TARGET.tensorrt_version),
            onnxruntime_problem(_distributions(), providers),
        )
        if p
    ]
    if missing:
        for line in missing:
            print(f"gpu-check: {line}", file=sys.stderr)
        return MISSING
    print(
        f"gpu-check on {torch.cuda.get_device_name(0)} (torch {torch.__version__}, TensorRT {trt_version})",
        flush=True,
    )
    started = time.monotonic()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        steps = run_check(args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="skewserve-gpu-check-") as tmp:
            steps = run_check(Path(tmp))
    print()
    print(render_table(steps))
    print(f"total {time.monotonic() - started:.0f} s")
    return 0 if steps and all(s.ok for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
