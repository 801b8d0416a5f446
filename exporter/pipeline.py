"""Artifact -> verified model version in a Triton repository, in one call."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from exporter.contract import LABELS_FILE, ServingContract
from exporter.errors import ExportError
from exporter.graph import ServingModule
from exporter.onnx_export import OPSET, convert_fp16, export_onnx
from exporter.parity import ParityReport, compare, onnxruntime_runner, parity_rows, require, torch_runner
from exporter.publish import CARD, Published, new_staging_dir, publish_version
from exporter.target import TARGET
from exporter.triton_config import LOCAL_PROFILE, ConfigOptions, gpu_config, local_config, render
from training.artifact import load_model

logger = logging.getLogger(__name__)
LOCAL_RUNNER = Path(__file__).with_name("local_backend_model.py")
CANARY_ROWS = 8


@dataclass
class ExportResult:
    published: Published
    parity: list[ParityReport]
    tensorrt: bool
    notices: list[str] = field(default_factory=list)


def _validation_rows(meta: dict[str, Any]) -> tuple[np.ndarray | None, str]:
    from training.data import load_data_dir

    data_dir = meta.get("provenance", {}).get("data_dir")
    if not data_dir:
        return None, "artifact names no data_dir; parity used random rows only"
    try:
        return load_data_dir(Path(data_dir)).val.features, f"validation rows from {data_dir}"
    except Exception as exc:  # missing or moved data must not block a publish; random rows still run
        return None, f"validation rows unavailable ({exc}); parity used random rows only"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_artifact(
    artifact: Path,
    repo: Path | str,
    name: str,
    version: int | None = None,
    precision: str = "fp32",
    tensorrt: str = "auto",
    options: ConfigOptions | None = None,
) -> ExportResult:
    """Export, verify and publish one version; nothing becomes visible unless every check passed.

    `repo` is a folder, or `s3://bucket/prefix` for a repository on object storage.
    """
    from exporter.object_store import export_to_object_store, is_object_store_url
    from exporter.tensorrt_build import build_plan, resolve_mode, tensorrt_runner

    if is_object_store_url(repo):
        return export_to_object_store(
            export_artifact, artifact, str(repo), name, version,
            precision=precision, tensorrt=tensorrt, options=options,
        )  # fmt: skip

    if precision not in ("fp32", "fp16"):
        raise ExportError(f"--precision must be fp32 or fp16, got {precision!r}")
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ExportError(
            f"model name {name!r} must be letters, digits, '-' or '_' (it becomes a folder and a URL part)"
        )
    opts = options or ConfigOptions()
    use_trt = resolve_mode(tensorrt)
    model, meta = load_model(artifact)
    contract = ServingContract.from_metadata(meta)
    module = ServingModule(model)
    model_dir = Path(repo) / name
    staging = new_staging_dir(model_dir)
    try:
        started = time.monotonic()
        fp32 = export_onnx(module, contract, staging / "model.onnx", opts.max_batch_size)
        val_rows, rows_note = _validation_rows(meta)
        batches = parity_rows(meta, val_rows, opts.max_batch_size)
        reference = torch_runner(module)
        reports = [
            require(
                compare(
                    reference, onnxruntime_runner(fp32.SerializeToString()), batches, "onnxruntime", "fp32"
                )
            )
        ]
        served = fp32
        if precision == "fp16":
            served = convert_fp16(fp32, staging / "model.onnx")
            reports.append(
                require(
                    compare(
                        reference,
                        onnxruntime_runner(served.SerializeToString()),
                        batches,
                        "onnxruntime",
                        "fp16",
                    )
                )
            )
        ort_served = onnxruntime_runner(served.SerializeToString())
        if use_trt:
            plan = build_plan(
                staging / "model.onnx",
                staging / "model.plan",
                contract.n_features,
                opts.max_batch_size,
                fp16=precision == "fp16",
                timing_cache=Path(repo) / ".tensorrt_timing_cache",
            )
            reports.append(
                require(compare(ort_served, tensorrt_runner(plan), batches, "tensorrt", precision))
            )
        shutil.copy2(LOCAL_RUNNER, staging / "model.py")
        canary_x = (val_rows[:CANARY_ROWS] if val_rows is not None else batches[0][:CANARY_ROWS]).astype(
            np.float32
        )
        canary_y = ort_served(canary_x)
        card = {
            "name": name,
            "artifact": {"path": str(Path(artifact).resolve()), "metadata": meta},
            "export": {
                "precision": precision,
                "opset": OPSET,
                "onnx_ir_version": served.ir_version,
                "tensorrt": use_trt,
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
                "inputs": canary_x.tolist(),
                "outputs": {k: v.tolist() for k, v in canary_y.items()},
                "tolerance": reports[-1].tolerance,
            },
        }
        (staging / CARD).write_text(json.dumps(card, indent=2))
        files = {
            "config.pbtxt": render(gpu_config(name, contract, opts, tensorrt_plan=use_trt)),
            f"configs/{LOCAL_PROFILE}.pbtxt": render(local_config(name, contract, opts)),
            LABELS_FILE: "\n".join(contract.classes) + "\n",
        }
        published = publish_version(model_dir, staging, files, version)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    notices = [] if use_trt or tensorrt == "off" else ["TensorRT plan skipped (no GPU / tensorrt here)"]
    return ExportResult(published, reports, use_trt, notices)
