"""Artifact -> verified model version in a Triton repository, in one call."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx

from exporter.contract import LABELS_FILE, ServingContract
from exporter.errors import ExportError
from exporter.graph import serving_module
from exporter.onnx_export import OPSET, convert_fp16, export_onnx, quantize_int8
from exporter.parity import (
    TF32_TOLERANCE,
    TOLERANCE,
    Inputs,
    ParityReport,
    Runner,
    compare,
    compare_labels,
    gpu_canary_tolerance,
    onnxruntime_runner,
    require,
    synthetic_batches,
    torch_runner,
    torchscript_runner,
    validation_batches,
)
from exporter.raw_inputs import publish_raw_models
from exporter.target import TARGET
from exporter.tensorrt_build import (
    TensorRTOptions,
    build_plans,
    resolve_mode,
    tensorrt_runner,
    tensorrt_unavailable_reason,
)
from exporter.triton_config import ConfigOptions, gpu_config, local_config
from repository.backend import recorded_backend
from repository.disk import new_staging_dir
from repository.layout import CARD, MODEL_FILE_ORDER, Published
from repository.model_config import LOCAL_PROFILE, render
from repository.object_publish import publish_version as publish_to_object_store
from repository.publish import publish_version
from repository.s3 import ObjectRepository, is_object_store_url, store_errors
from training.artifact import load_model

logger = logging.getLogger(__name__)
LOCAL_RUNNER = Path(__file__).with_name("local_backend_model.py")
LOCAL_TORCH_RUNNER = Path(__file__).with_name("local_torch_model.py")
LOCAL_BATCHING = Path(__file__).with_name("local_batching.py")
FORMATS = ("onnx", "torchscript")
PRECISIONS = ("fp32", "fp16", "int8")
CANARY_ROWS = 8


@dataclass
class ExportResult:
    published: Published
    parity: list[ParityReport]
    tensorrt: bool
    notices: list[str] = field(default_factory=list)
    raw_models: list[Published] = field(default_factory=list)  # <name>_preprocess and <name>_raw


def _parity_batches(
    meta: dict[str, Any], contract: ServingContract, max_batch: int
) -> tuple[list[Inputs], str, str | None]:
    """Real validation batches, else synthetic ones with a notice saying the gate is weaker."""
    data_dir = meta.get("provenance", {}).get("data_dir")
    reason = "the artifact names no data directory"
    if data_dir:
        try:
            batches = validation_batches(meta, max_batch)
            rows = sum(len(b[0]) for b in batches)
            if rows:
                return batches, f"{rows} validation rows from {data_dir}", None
            reason = f"{data_dir} has an empty validation split"
        except Exception as exc:  # moved or unreadable data must not block a publish: say so instead
            reason = f"validation data at {data_dir} unavailable ({exc})"
    batches = synthetic_batches(contract, meta, max_batch)
    rows = sum(len(b[0]) for b in batches)
    note = f"{reason}; parity used {rows} synthetic rows only"
    return batches, note, f"parity gate weakened: {note}"


def _example(batches: list[Inputs]) -> Inputs:
    """A batch of at least two rows (torch.export specialises dimensions of size 1)."""
    return max(batches[:12], key=lambda b: (min(len(b[0]), 8), *(x.size for x in b)))


def _canary_record(inputs: Inputs, contract: ServingContract) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "datatype": t.triton_dtype, "shape": list(x.shape), "data": x.reshape(-1).tolist()}
        for t, x in zip(contract.inputs, inputs, strict=True)
    ]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _use_tensorrt(
    mode: str, fmt: str, kept: str | None, change_backend: bool, opts: ConfigOptions, notices: list[str]
) -> bool:
    """Whether this export builds plans: the model's recorded backend decides `auto`, not the host."""
    if mode not in {"auto", "on", "off"}:
        raise ExportError(f"--tensorrt must be auto, on or off, got {mode!r}")
    if fmt == "torchscript":
        if mode == "on":
            raise ExportError("--tensorrt on builds a plan from ONNX; use --format onnx (or --tensorrt off)")
        return False
    if mode != "auto":
        return resolve_mode(mode)
    if opts.ort_tensorrt != "off":
        return False  # the onnxruntime backend with its own TensorRT accelerator
    if kept == "onnxruntime" and not change_backend:
        if tensorrt_unavailable_reason() is None:
            notices.append(
                "TensorRT plan not built: the model serves with onnxruntime (serving_backend.json); "
                "--tensorrt on --change-backend switches it"
            )
        return False
    if kept == "tensorrt" and not change_backend:
        reason = tensorrt_unavailable_reason()
        if reason is not None:
            raise ExportError(
                f"the model serves TensorRT plans (serving_backend.json), but this host cannot build one: "
                f"{reason}. Export on a GPU host with the gpu extra, or pass --tensorrt off --change-backend"
            )
        return True
    return resolve_mode("auto")


def export_artifact(
    artifact: Path,
    repo: Path | str,
    name: str,
    version: int | None = None,
    precision: str = "fp32",
    tensorrt: str = "auto",
    options: ConfigOptions | None = None,
    fmt: str = "onnx",
    trt_options: TensorRTOptions | None = None,
    change_backend: bool = False,
) -> ExportResult:
    """Export, verify and publish one version; nothing becomes visible unless every check passed.

    `repo` is a folder, or `s3://bucket/prefix` for a repository on object storage (exported and
    checked in a private folder exactly as for disk, then uploaded: repository/object_publish.py).
    `fmt` is `onnx` (onnxruntime backend, or TensorRT plans built from the ONNX graph) or
    `torchscript` (libtorch).
    """
    how = dict(precision=precision, tensorrt=tensorrt, options=options, fmt=fmt, trt_options=trt_options)
    if not is_object_store_url(repo):
        return _export_to_disk(artifact, Path(repo), name, version, change_backend=change_backend, **how)  # type: ignore[arg-type]
    store = ObjectRepository.parse(str(repo))
    with tempfile.TemporaryDirectory(prefix="skewserve-s3-staging-") as tmp:
        result = _export_to_disk(artifact, Path(tmp), name, None, change_backend=change_backend, **how)  # type: ignore[arg-type]
        model_dir = Path(tmp) / name
        model_files = {
            rel: (model_dir / rel).read_text() for rel in MODEL_FILE_ORDER if (model_dir / rel).is_file()
        }
        with store_errors(store):
            published = publish_to_object_store(
                store, name, result.published.path, model_files, version, allow_backend_change=change_backend
            )
    return replace(result, published=replace(published, path=Path(f"{store.url}/{name}/{published.version}")))


def _export_to_disk(
    artifact: Path,
    repo: Path,
    name: str,
    version: int | None,
    precision: str,
    tensorrt: str,
    options: ConfigOptions | None,
    fmt: str,
    trt_options: TensorRTOptions | None,
    change_backend: bool,
) -> ExportResult:
    if precision not in PRECISIONS:
        raise ExportError(f"--precision must be fp32, fp16 or int8, got {precision!r}")
    if precision == "int8" and (tensorrt == "on" or (options and options.ort_tensorrt != "off")):
        raise ExportError(
            "--precision int8 is an ONNX Runtime CPU graph (served on CPU instances, GPU servers too); "
            "TensorRT does not build it: drop --tensorrt on / --ort-tensorrt, or export fp16 for GPUs"
        )
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "torchscript" and precision != "fp32":
        raise ExportError("--format torchscript exports FP32 only; use --format onnx for --precision fp16")
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ExportError(
            f"model name {name!r} must be letters, digits, '-' or '_' (it becomes a folder and a URL part)"
        )
    opts = options or ConfigOptions()
    trt_opts = trt_options or TensorRTOptions()
    model_dir = Path(repo) / name
    notices: list[str] = []
    use_trt = precision != "int8" and _use_tensorrt(
        tensorrt, fmt, recorded_backend(model_dir), change_backend, opts, notices
    )
    if use_trt and opts.ort_tensorrt != "off":
        raise ExportError(
            "--ort-tensorrt configures the onnxruntime backend, but this export builds TensorRT plans: "
            "pass --tensorrt off with --ort-tensorrt"
        )
    backend = "pytorch" if fmt == "torchscript" else "tensorrt" if use_trt else "onnxruntime"
    model, meta = load_model(artifact)
    contract = ServingContract.from_metadata(meta)
    module = serving_module(model, contract.input_names)
    source = meta["model"].get("name", "mlp")
    staging = new_staging_dir(model_dir)
    try:
        started = time.monotonic()
        batches, rows_note, weakened = _parity_batches(meta, contract, opts.max_batch_size)
        if weakened:
            notices.append(weakened)
        reference = torch_runner(module)
        reports: list[ParityReport] = []
        trt_record = None
        cc_plans: dict[str, str] = {}
        if fmt == "torchscript":
            from exporter.torchscript_export import export_torchscript

            sized = sorted({len(b[0]): b for b in batches if len(b[0]) > 1}.items())
            export_torchscript(module, [b for _, b in sized[:3]] or batches[:1], staging / "model.pt")
            served: Runner = torchscript_runner(str(staging / "model.pt"))
            reports.append(require(compare(reference, served, batches, "torchscript", "fp32")))
            ir_version = None
            shutil.copy2(LOCAL_TORCH_RUNNER, staging / "model.py")
            shutil.copy2(LOCAL_BATCHING, staging / "batching.py")
        else:
            fp32 = export_onnx(
                module, contract, staging / "model.onnx", opts.max_batch_size, _example(batches), repr(source)
            )
            reports.append(
                require(
                    compare(
                        reference,
                        onnxruntime_runner(fp32.SerializeToString()),
                        batches,
                        "onnxruntime",
                        "fp32",
                    )
                )
            )
            served_onnx = fp32
            if precision == "fp16":
                served_onnx = convert_fp16(fp32, staging / "model.onnx")
                reports.append(
                    require(
                        compare(
                            reference,
                            onnxruntime_runner(served_onnx.SerializeToString()),
                            batches,
                            "onnxruntime",
                            "fp16",
                        )
                    )
                )
            if precision == "int8":
                with tempfile.TemporaryDirectory(prefix="skewserve-int8-") as tmp:
                    fp32_path = Path(tmp) / "model.fp32.onnx"
                    shutil.move(staging / "model.onnx", fp32_path)
                    served_onnx = quantize_int8(fp32_path, staging / "model.onnx", batches)
                # Judged against the FP32 graph (already checked against PyTorch) on label agreement.
                reports.append(
                    require(
                        compare_labels(
                            onnxruntime_runner(fp32.SerializeToString()),
                            onnxruntime_runner(served_onnx.SerializeToString()),
                            batches,
                            list(contract.classes),
                            "onnxruntime",
                        )
                    )
                )
            served = onnxruntime_runner(served_onnx.SerializeToString())
            ir_version = served_onnx.ir_version
            if use_trt:
                # Plans are compared with the PyTorch reference itself, at the precision they compute in.
                limit = (
                    TOLERANCE["fp16"] if precision == "fp16" else TF32_TOLERANCE if trt_opts.tf32 else None
                )

                def check_plan(filename: str, plan: bytes) -> None:
                    runner = tensorrt_runner(plan, trt_opts.version_compatible)
                    report = compare(reference, runner, batches, f"tensorrt {filename}", precision, limit)
                    reports.append(require(report))

                trt_record = build_plans(
                    staging / "model.onnx",
                    staging,
                    contract,
                    opts.max_batch_size,
                    fp16=precision == "fp16",
                    timing_cache=Path(repo) / ".tensorrt_timing_cache",
                    opts=trt_opts,
                    check=check_plan,
                )
                cc_plans = {p.compute_capability: p.file for p in trt_record.plans}
            shutil.copy2(LOCAL_RUNNER, staging / "model.py")
            shutil.copy2(LOCAL_BATCHING, staging / "batching.py")
        first = max(batches, key=lambda b: min(len(b[0]), CANARY_ROWS))
        canary_x = tuple(x[:CANARY_ROWS] for x in first)
        canary_y = served(canary_x)
        # int8 runs on CPU instances everywhere: GPU servers answer as the exporter's runtime does.
        gpu_tol = (
            TOLERANCE["int8"]
            if precision == "int8"
            else gpu_canary_tolerance(backend, precision, opts.ort_tensorrt, trt_opts.tf32)
        )
        card = {
            "name": name,
            "artifact": {"path": str(Path(artifact).resolve()), "metadata": meta},
            "export": {
                "format": fmt,
                "backend": backend,
                "precision": precision,
                "opset": OPSET if fmt == "onnx" else None,
                "onnx_ir_version": ir_version,
                # TensorRT version, GPU name and compute capability of every plan, and how it was built.
                "tensorrt": trt_record.model_dump() if trt_record is not None else None,
                "serving_target": TARGET.as_dict(),  # the Triton image (and TensorRT) this is built for
                "max_batch_size": opts.max_batch_size,
                "options": opts.model_dump(),
                "parity_rows": rows_note,
                "seconds": round(time.monotonic() - started, 2),
                "onnx": onnx.__version__,
                "files": {p.name: _sha256(p) for p in sorted(staging.iterdir()) if p.is_file()},
            },
            "parity": [r.as_dict() for r in reports],
            "canary": {
                "inputs": _canary_record(canary_x, contract),
                "outputs": {k: v.tolist() for k, v in canary_y.items()},
                # CPU servers run the exporter's own runtime; GPU servers get the stated GPU limit.
                "tolerance": TOLERANCE[precision],
                "gpu_tolerance": gpu_tol,
            },
        }
        (staging / CARD).write_text(json.dumps(card, indent=2))
        files = {
            "config.pbtxt": render(
                gpu_config(
                    name, contract, opts, backend=backend, cc_plans=cc_plans, cpu_only=precision == "int8"
                )
            ),
            f"configs/{LOCAL_PROFILE}.pbtxt": render(local_config(name, contract, opts, backend=backend)),
            LABELS_FILE: "\n".join(contract.classes) + "\n",
        }
        published = publish_version(model_dir, staging, files, version, allow_backend_change=change_backend)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    raw_models = publish_raw_models(Path(repo), name, published.version, meta, contract, opts)
    if (
        not use_trt
        and tensorrt == "auto"
        and fmt == "onnx"
        and precision != "int8"
        and not notices
        and opts.ort_tensorrt == "off"
    ):
        notices.append("TensorRT plan skipped (no GPU / tensorrt here)")
    return ExportResult(published, reports, use_trt, notices, raw_models)
