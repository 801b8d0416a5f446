"""Numerical parity between the PyTorch serving module and a compiled model, before anything ships.

Errors are measured on the softmax probabilities (bounded in [0, 1], what clients consume); the
logits' error is reported beside them. Rows: the artifact's validation split, plus random rows
drawn around the training distribution (mean + std * N(0, 1)) at batch sizes 1..max.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from exporter.contract import INPUT_NAME, LABEL, LOGITS, PROBABILITIES
from exporter.errors import ParityError
from exporter.graph import ServingModule

TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}
# TF32 keeps 10 mantissa bits (unit round-off 2**-11 ~ 4.9e-4 per product, NVIDIA's Ampere TF32
# note); through the MLP's matmuls and the softmax that stays well under 5e-3 on probabilities.
# Used where TF32 may be on: FP32 plans built with --trt-tf32, and the onnxruntime backend on GPU
# servers (ONNX Runtime's CUDA provider enables TF32 by default, `use_tf32`).
TF32_TOLERANCE = 5e-3
MIN_AGREEMENT = 0.999

Runner = Callable[[np.ndarray], dict[str, np.ndarray]]


@dataclass(frozen=True)
class ParityReport:
    target: str
    precision: str
    rows: int
    batch_sizes: list[int]
    max_abs_error_probabilities: float
    max_abs_error_logits: float
    argmax_agreement: float
    tolerance: float
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"{self.target} {self.precision}: max |Δp| {self.max_abs_error_probabilities:.2e} (limit {self.tolerance:.0e}), "
            f"max |Δlogit| {self.max_abs_error_logits:.2e}, arg-max agreement {100 * self.argmax_agreement:.2f}% "
            f"(limit {100 * MIN_AGREEMENT:.1f}%) over {self.rows} rows"
        )


def batch_sizes(max_batch: int) -> list[int]:
    sizes = {1, 2, 3, 5, 8, max_batch, max(1, max_batch // 2), max(1, max_batch - 1)}
    sizes |= {2**k for k in range(10) if 2**k <= max_batch}
    return sorted(s for s in sizes if 1 <= s <= max_batch)


def parity_rows(
    meta: dict[str, Any], val_rows: np.ndarray | None, max_batch: int, seed: int = 0
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    mean = np.asarray(meta["normalisation"]["mean"], dtype=np.float32)
    std = np.asarray(meta["normalisation"]["std"], dtype=np.float32)
    batches = [
        (mean + std * rng.standard_normal((b, len(mean)))).astype(np.float32) for b in batch_sizes(max_batch)
    ]
    if val_rows is not None and len(val_rows):
        batches += [val_rows[i : i + max_batch] for i in range(0, len(val_rows), max_batch)]
    return batches


def torch_runner(module: ServingModule) -> Runner:
    def run(x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.no_grad():
            logits, probs, label = module(torch.from_numpy(x))
        return {LOGITS: logits.numpy(), PROBABILITIES: probs.numpy(), LABEL: label.numpy()}

    return run


def onnxruntime_runner(model_bytes: bytes, provider: str = "CPUExecutionProvider") -> Runner:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    available = ort.get_available_providers()
    if provider not in available:
        raise RuntimeError(
            f"ONNX Runtime here has no {provider} (it has {', '.join(available)}); for CUDA install "
            "onnxruntime-gpu in place of onnxruntime (README, 'Export for a GPU fleet')"
        )
    # Pinning the one provider: ONNX Runtime must not fall back to the CPU behind our back.
    session = ort.InferenceSession(model_bytes, opts, providers=[provider])
    names = [o.name for o in session.get_outputs()]

    def run(x: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {INPUT_NAME: x}), strict=True))

    return run


def gpu_canary_tolerance(
    backend: str, precision: str, ort_tensorrt: str = "off", tf32: bool = False
) -> float:
    """The stated limit for a GPU server's canary against the exporter's CPU reference outputs.

    FP16 anywhere (the model, a plan, the onnxruntime TensorRT accelerator) -> the FP16 limit; the
    onnxruntime backend on GPU or a plan built with TF32 -> the TF32 limit; FP32 plans (TF32 off)
    and TorchScript on libtorch (torch keeps TF32 matmuls off by default) -> the FP32 limit.
    """
    if precision == "fp16" or ort_tensorrt == "fp16":
        return TOLERANCE["fp16"]
    if backend == "onnxruntime" or tf32:
        return TF32_TOLERANCE
    return TOLERANCE["fp32"]


def torchscript_runner(path: str, device: str = "cpu") -> Runner:
    """Run a saved TorchScript serving module as Triton's libtorch backend would (fresh load)."""
    module = torch.jit.load(path, map_location=device)
    module.eval()

    def run(x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.no_grad():
            logits, probs, label = module(torch.from_numpy(x).to(device))
        return {LOGITS: logits.cpu().numpy(), PROBABILITIES: probs.cpu().numpy(), LABEL: label.cpu().numpy()}

    return run


def compare(
    reference: Runner,
    candidate: Runner,
    batches: list[np.ndarray],
    target: str,
    precision: str,
    tolerance: float | None = None,
) -> ParityReport:
    err_p = err_l = 0.0
    agree = total = 0
    for x in batches:
        want, got = reference(x), candidate(x)
        err_p = max(err_p, float(np.abs(want[PROBABILITIES] - got[PROBABILITIES].astype(np.float32)).max()))
        err_l = max(err_l, float(np.abs(want[LOGITS] - got[LOGITS].astype(np.float32)).max()))
        agree += int((want[LABEL].reshape(-1) == got[LABEL].reshape(-1)).sum())
        total += len(x)
    tol = TOLERANCE[precision] if tolerance is None else tolerance
    agreement = agree / max(1, total)
    return ParityReport(
        target=target,
        precision=precision,
        rows=total,
        batch_sizes=sorted({len(b) for b in batches}),
        max_abs_error_probabilities=err_p,
        max_abs_error_logits=err_l,
        argmax_agreement=agreement,
        tolerance=tol,
        passed=err_p <= tol and agreement >= MIN_AGREEMENT,
    )


def require(report: ParityReport) -> ParityReport:
    if not report.passed:
        raise ParityError(f"refusing to publish: parity failed for {report.summary()}")
    return report
