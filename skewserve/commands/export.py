"""`skewserve export`: a thin layer over `exporter.pipeline.export_artifact`.

torch and onnx load with the exporter's modules, so they are imported inside the command: `--help`
stays instant, and the gateway image (which has only a few exporter modules) can load this module.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

from skewserve.commands.foreground import setup_logging
from skewserve.output import console, error, notice, say, text


def export_command(
    artifact: Path = typer.Option(..., "--artifact", help="Artifact directory written by `skewserve train`."),
    repo: str = typer.Option(
        "model_repository",
        "--repo",
        help="Triton model repository: a folder, or s3://BUCKET/PREFIX (endpoint from AWS_ENDPOINT_URL_S3).",
    ),
    name: str = typer.Option(..., "--name", help="Model name (folder and URL part)."),
    version: int | None = typer.Option(
        None, "--version", help="Version to publish; default max+1. Never overwrites."
    ),
    precision: str = typer.Option(
        "fp32",
        "--precision",
        help="fp32 | fp16 (FP32 at the boundary) | int8 (ONNX Runtime static quantization, CPU "
        "instances; gated on label agreement with FP32, docs/export.md#int8-for-cpus).",
    ),
    tensorrt: str = typer.Option("auto", "--tensorrt", help="auto | on | off: TensorRT plan on a CUDA GPU."),
    max_batch: int = typer.Option(
        64, "--max-batch", min=1, help="Triton max_batch_size and parity batch range."
    ),
    response_cache: bool = typer.Option(
        False, "--response-cache", help="Enable Triton's response cache in both configs (GPU and local)."
    ),
    fmt: str = typer.Option(
        "onnx", "--format", help="onnx (onnxruntime / TensorRT) | torchscript (pytorch_libtorch)."
    ),
    change_backend: bool = typer.Option(
        False, "--change-backend", help="Allow this version to change the model's serving backend."
    ),
    keep_versions: int = typer.Option(
        2,
        "--keep-versions",
        min=1,
        help="Unused since desired state: servers load the promoted version (skewserve rollout); "
        "old versions are removed by the controller (skewserve controller --keep-versions).",
    ),
    ort_tensorrt: str = typer.Option(
        "off", "--ort-tensorrt", help="off | fp32 | fp16: onnxruntime's TensorRT accelerator on GPU servers."
    ),
    ort_tensorrt_cache_dir: str = typer.Option(
        "/tmp/skewserve-ort-trt-cache", "--ort-tensorrt-cache-dir", help="Engine cache folder on the servers."
    ),
    trt_version_compatible: bool = typer.Option(
        False, "--trt-version-compatible", help="Plans that also load on later TensorRT of the same major."
    ),
    trt_hardware_compatibility: str = typer.Option(
        "none", "--trt-hardware-compatibility", help="none | ampere_plus: one plan for every 8.0+ GPU."
    ),
    trt_tf32: bool = typer.Option(
        False, "--trt-tf32", help="Allow TF32 in FP32 plans (parity limit 5e-3 instead of 1e-4)."
    ),
) -> None:
    """Compile an artifact to ONNX (+ TensorRT on GPU) or TorchScript, check parity, publish a new immutable version.

    Docs: docs/export.md"""
    # lazy: torch and onnx load with the exporter, kept out of --help and the gateway image
    from pydantic import ValidationError

    from exporter.errors import ExportError
    from exporter.pipeline import export_artifact
    from exporter.tensorrt_build import TensorRTOptions
    from exporter.triton_config import ConfigOptions
    from repository.errors import RepositoryError
    from repository.s3 import is_object_store_url

    try:
        config_options = ConfigOptions(
            max_batch_size=max_batch,
            response_cache=response_cache,
            keep_versions=keep_versions,
            ort_tensorrt=ort_tensorrt,  # type: ignore[arg-type]
            ort_tensorrt_cache_dir=ort_tensorrt_cache_dir,
        )
        trt_options = TensorRTOptions(
            version_compatible=trt_version_compatible,
            hardware_compatibility=trt_hardware_compatibility,  # type: ignore[arg-type]
            tf32=trt_tf32,
        )
    except ValidationError as exc:
        bad = exc.errors()[0]
        raise typer.BadParameter(f"{bad['loc'][0]}: {bad['msg']}") from exc

    setup_logging(False)
    # onnx_ir and onnxscript's optimizer log each graph rewrite at INFO: noise for a person exporting.
    for noisy in ("onnx_ir", "onnxscript"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    in_object_store = is_object_store_url(repo)
    try:
        with console.status(text(f"exporting {artifact} as {name}")):
            result = export_artifact(
                artifact,
                repo if in_object_store else Path(repo),
                name,
                version=version,
                precision=precision,
                tensorrt=tensorrt,
                options=config_options,
                fmt=fmt,
                trt_options=trt_options,
                change_backend=change_backend,
            )
    except (ExportError, RepositoryError, FileNotFoundError, ValueError) as exc:
        error(exc)
        raise typer.Exit(1) from exc
    where = f"{repo.rstrip('/')}/{name}/{result.published.version}" if in_object_store else None
    print_export(result, name, where)


def print_export(result: Any, name: str, where: str | None) -> None:
    """What the export checked and published; `where` names the version in an object store."""
    for line in result.notices:
        notice(line)
    for report in result.parity:
        say(f"parity {report.summary()}")
    say(
        f"published {result.published.name} version {result.published.version} at {where or result.published.path}"
    )
    for raw in result.raw_models:
        say(f"published {raw.name} version {raw.version} at {raw.path}")
    if result.raw_models:
        say(
            f"raw inputs: call {name}_raw with input 'raw' (BYTES, one encoded image or UTF-8 text per row); "
            f"{name} takes tensors"
        )
