"""Numerical parity between the PyTorch serving module and a compiled model, before anything ships.

Errors are measured on the softmax probabilities (bounded in [0, 1], what clients consume); the
logits' error is reported beside them. Rows: the artifact's validation split, plus random rows
Rows are real validation samples, read through the training data reader at batch sizes 1..max
(several sizes, so dynamic batching and padded dynamic dimensions are both exercised); only when
the data cannot be read does the gate fall back to synthetic inputs, and the export says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from exporter.contract import LABEL, LOGITS, PROBABILITIES, ServingContract
from exporter.errors import ParityError
from exporter.graph import ServingModule

# int8: the canary's limit on a server running the same quantized graph (fixed, calibrated scales:
# a row's answer does not depend on its batch); the gate itself judges int8 by label agreement.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "int8": 1e-3}
# TF32 keeps 10 mantissa bits (unit round-off 2**-11 ~ 4.9e-4 per product, NVIDIA's Ampere TF32
# note); through the MLP's matmuls and the softmax that stays well under 5e-3 on probabilities.
# Used where TF32 may be on: FP32 plans built with --trt-tf32, and the onnxruntime backend on GPU
# servers (ONNX Runtime's CUDA provider enables TF32 by default, `use_tf32`).
TF32_TOLERANCE = 5e-3
MIN_AGREEMENT = 0.999
# INT8 against FP32: quantization moves rows near a decision boundary, so labels are compared, not
# probabilities. Overall 0.98; each class FP32 predicts at least MIN_CLASS_ROWS times keeps 0.90
# of its rows (a class with fewer rows is reported, not judged: one row would swing it by 20%).
INT8_MIN_AGREEMENT = 0.98
INT8_MIN_CLASS_AGREEMENT = 0.90
MIN_CLASS_ROWS = 20

Inputs = tuple[np.ndarray, ...]  # one batch: an array per contract input, in the contract's order
Runner = Callable[[Inputs], dict[str, np.ndarray]]
PARITY_ROWS = 1200


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
    # int8 only: label agreement with FP32 per class FP32 predicted (rows, agreement).
    per_class_agreement: dict[str, dict[str, float]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        if self.per_class_agreement is not None:
            judged = [
                v["agreement"] for v in self.per_class_agreement.values() if v["rows"] >= MIN_CLASS_ROWS
            ]
            worst = min(judged, default=1.0)
            return (
                f"{self.target} {self.precision}: label agreement with FP32 {100 * self.argmax_agreement:.2f}% "
                f"(limit {100 * INT8_MIN_AGREEMENT:.0f}%), worst class {100 * worst:.2f}% "
                f"(limit {100 * INT8_MIN_CLASS_AGREEMENT:.0f}% per class with >= {MIN_CLASS_ROWS} rows), "
                f"max |Δp| {self.max_abs_error_probabilities:.2e} over {self.rows} rows"
            )
        return (
            f"{self.target} {self.precision}: max |Δp| {self.max_abs_error_probabilities:.2e} (limit {self.tolerance:.0e}), "
            f"max |Δlogit| {self.max_abs_error_logits:.2e}, arg-max agreement {100 * self.argmax_agreement:.2f}% "
            f"(limit {100 * MIN_AGREEMENT:.1f}%) over {self.rows} rows"
        )


def batch_sizes(max_batch: int) -> list[int]:
    sizes = {1, 2, 3, 5, 8, max_batch, max(1, max_batch // 2), max(1, max_batch - 1)}
    sizes |= {2**k for k in range(10) if 2**k <= max_batch}
    return sorted(s for s in sizes if 1 <= s <= max_batch)


def validation_batches(meta: dict[str, Any], max_batch: int, limit: int = PARITY_ROWS) -> list[Inputs]:
    """Real validation samples from the artifact's data, batched at the sizes `batch_sizes` lists."""
    from training.data_source import open_data
    from training.datasets import SplitDataset

    prov = meta.get("provenance", {})
    pre = meta.get("preprocessing", {})
    size = pre.get("size")
    data = open_data(
        prov["data_dir"],
        prov.get("label_column", "label"),
        image_size=None if size is None else int(size[0]),
        channels=pre.get("channels"),
        augment=False,
        val_fraction=prov.get("val_fraction"),
        seed=int(prov.get("seed", 0)),
    )
    val = SplitDataset(data.val, data.spec)
    sizes = batch_sizes(max_batch)
    out: list[Inputs] = []
    start = k = 0
    n = min(len(val), limit)
    while start < n:
        b = min(sizes[k % len(sizes)], n - start)
        inputs, _ = val.__getitems__(list(range(start, start + b)))
        out.append(tuple(t.numpy() for t in inputs))
        start, k = start + b, k + 1
    return out


def synthetic_batches(
    contract: ServingContract, meta: dict[str, Any], max_batch: int, seed: int = 0
) -> list[Inputs]:
    """Inputs drawn within each tensor's range, when no validation data can be read."""
    rng = np.random.default_rng(seed)
    pre = meta.get("preprocessing", {})
    out = []
    for b in batch_sizes(max_batch):
        batch = []
        for spec in contract.specs:
            dims = [r[1] for r in spec.ranges] if spec.ranges else [8] * spec.shape.count(-1)
            it = iter(dims)
            shape = (b, *(next(it) if d == -1 else d for d in spec.shape))
            if spec.dtype in ("float32", "float16"):
                x = rng.standard_normal(shape)
                mean, std = pre.get("mean"), pre.get("std")
                if meta.get("data_kind") == "table" and mean is not None and std is not None:
                    x = np.asarray(mean) + np.asarray(std) * x  # around the training distribution
                batch.append(np.asarray(x, dtype=spec.dtype))
            elif spec.dtype == "bool":
                batch.append(rng.random(shape) < 0.5)
            elif spec.dtype == "uint8":
                batch.append(rng.integers(0, 256, shape, dtype=np.uint8))
            else:
                top = (
                    int(pre.get("max_id", {}).get(spec.name, 1))
                    if "vocab" not in pre
                    else len(pre["vocab"]) + 1
                )
                batch.append(rng.integers(1, max(2, top + 1), shape).astype(spec.dtype))
        out.append(tuple(batch))
    return out


def torch_runner(module: ServingModule) -> Runner:
    def run(xs: Inputs) -> dict[str, np.ndarray]:
        with torch.no_grad():
            logits, probs, label = module(*(torch.from_numpy(np.ascontiguousarray(x)) for x in xs))
        return {LOGITS: logits.numpy(), PROBABILITIES: probs.numpy(), LABEL: label.numpy()}

    return run


def require_provider(in_use: list[str], wanted: str) -> None:
    """ONNX Runtime falls back to the CPU when a CUDA provider cannot start (a missing cuDNN, a
    driver too old) and only logs a warning: a GPU figure measured that way would be a CPU figure."""
    if not in_use or in_use[0] != wanted:
        raise RuntimeError(
            f"ONNX Runtime runs this session on {', '.join(in_use) or 'no provider'}, not {wanted}: the "
            f"{wanted} did not start (its libraries: CUDA, cuDNN; see ONNX Runtime's warning above)"
        )


def onnxruntime_runner(model_bytes: bytes, provider: str = "CPUExecutionProvider") -> Runner:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    available = ort.get_available_providers()
    if provider not in available:
        raise RuntimeError(
            f"ONNX Runtime here has no {provider} (it has {', '.join(available)}); for CUDA install "
            "onnxruntime-gpu in place of onnxruntime (docs/export.md#export-for-a-gpu-fleet)"
        )
    # Pinning the one provider: ONNX Runtime must not fall back to the CPU behind our back.
    session = ort.InferenceSession(model_bytes, opts, providers=[provider])
    require_provider(session.get_providers(), provider)
    names = [o.name for o in session.get_outputs()]
    input_names = [i.name for i in session.get_inputs()]

    def run(xs: Inputs) -> dict[str, np.ndarray]:
        feed = dict(zip(input_names, xs, strict=True))
        return dict(zip(names, session.run(names, feed), strict=True))

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

    def run(xs: Inputs) -> dict[str, np.ndarray]:
        with torch.no_grad():
            logits, probs, label = module(*(torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in xs))
        return {LOGITS: logits.cpu().numpy(), PROBABILITIES: probs.cpu().numpy(), LABEL: label.cpu().numpy()}

    return run


def compare(
    reference: Runner,
    candidate: Runner,
    batches: list[Inputs],
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
        total += len(x[0])
    tol = TOLERANCE[precision] if tolerance is None else tolerance
    agreement = agree / max(1, total)
    return ParityReport(
        target=target,
        precision=precision,
        rows=total,
        batch_sizes=sorted({len(b[0]) for b in batches}),
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


def compare_labels(
    reference: Runner, candidate: Runner, batches: list[Inputs], classes: list[str], target: str
) -> ParityReport:
    """A quantized graph against FP32: label agreement overall and per class FP32 predicted."""
    err_p = err_l = 0.0
    want_labels, got_labels = [], []
    for x in batches:
        want, got = reference(x), candidate(x)
        err_p = max(err_p, float(np.abs(want[PROBABILITIES] - got[PROBABILITIES].astype(np.float32)).max()))
        err_l = max(err_l, float(np.abs(want[LOGITS] - got[LOGITS].astype(np.float32)).max()))
        want_labels.append(want[LABEL].reshape(-1))
        got_labels.append(got[LABEL].reshape(-1))
    w, g = np.concatenate(want_labels), np.concatenate(got_labels)
    per_class = {}
    for index, name in enumerate(classes):
        rows = w == index
        per_class[name] = {
            "rows": int(rows.sum()),
            "agreement": float((g[rows] == index).mean()) if rows.any() else 1.0,
        }
    agreement = float((w == g).mean()) if len(w) else 1.0
    judged = [v["agreement"] for v in per_class.values() if v["rows"] >= MIN_CLASS_ROWS]
    return ParityReport(
        target=target,
        precision="int8",
        rows=len(w),
        batch_sizes=sorted({len(b[0]) for b in batches}),
        max_abs_error_probabilities=err_p,
        max_abs_error_logits=err_l,
        argmax_agreement=agreement,
        tolerance=TOLERANCE["int8"],
        passed=agreement >= INT8_MIN_AGREEMENT and min(judged, default=1.0) >= INT8_MIN_CLASS_AGREEMENT,
        per_class_agreement=per_class,
    )
