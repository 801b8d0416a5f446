"""Triton model configs, built as `ModelConfig` protobufs and rendered to text, never hand-typed.

Two profiles per model: `config.pbtxt` for GPU servers (NGC container; the onnxruntime backend,
optionally with its TensorRT execution accelerator, TensorRT plans, or a TorchScript model on
libtorch) and `configs/local.pbtxt` for the local CPU server, selected with
`tritonserver --model-config-name=local` (Python backend running the same model.onnx or model.pt).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field
from tritonclient.grpc import model_config_pb2 as mc

from exporter.contract import ServingContract, TensorSpec
from repository.model_config import BACKENDS, MODEL_FILES

DTYPES = {
    "FP32": mc.TYPE_FP32,
    "FP16": mc.TYPE_FP16,
    "INT64": mc.TYPE_INT64,
    "INT32": mc.TYPE_INT32,
    "UINT8": mc.TYPE_UINT8,
    "BOOL": mc.TYPE_BOOL,
}


class ConfigOptions(BaseModel):
    max_batch_size: int = Field(default=64, ge=1)
    preferred_batch_sizes: list[int] = Field(default_factory=lambda: [8, 32])
    max_queue_delay_us: int = Field(default=100, ge=0)
    gpu_instances: int = Field(default=1, ge=1)
    cpu_instances: int = Field(default=1, ge=1)
    keep_versions: int = Field(default=2, ge=1)
    response_cache: bool = False
    warmup_batch: int = Field(default=8, ge=1)
    ort_threads: int = Field(default=1, ge=1)
    ort_tensorrt: Literal["off", "fp32", "fp16"] = Field(
        default="off",
        description="onnxruntime backend on GPU: run the graph through its TensorRT execution accelerator "
        "at this precision (precision_mode), engines cached on the server",
    )
    ort_tensorrt_cache_dir: str = Field(
        default="/tmp/skewserve-ort-trt-cache",
        description="server-side folder for the accelerator's engine cache (trt_engine_cache_path/<model>)",
    )
    ort_tensorrt_workspace_bytes: int = Field(default=1 << 30, ge=1 << 20)


def _tensors(container: object, specs: tuple[TensorSpec, ...]) -> None:
    for spec in specs:
        t = container.add()  # type: ignore[attr-defined]
        t.name = spec.name
        t.data_type = DTYPES[spec.triton_dtype]
        t.dims.extend(spec.dims)
        if spec.label_filename:
            t.label_filename = spec.label_filename


def _common(name: str, contract: ServingContract, opts: ConfigOptions) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, max_batch_size=opts.max_batch_size)
    _tensors(cfg.input, contract.inputs)
    _tensors(cfg.output, contract.outputs)
    preferred = [b for b in opts.preferred_batch_sizes if b <= opts.max_batch_size]
    cfg.dynamic_batching.preferred_batch_size.extend(preferred)
    cfg.dynamic_batching.max_queue_delay_microseconds = opts.max_queue_delay_us
    cfg.version_policy.latest.num_versions = opts.keep_versions
    warm = cfg.model_warmup.add(name="random_batch", batch_size=min(opts.warmup_batch, opts.max_batch_size))
    for spec in contract.inputs:
        # Warm-up needs concrete dims: a dynamic one takes the typical (median) training length.
        typical = iter(r[1] for r in spec.ranges)
        warm.inputs[spec.name].data_type = DTYPES[spec.triton_dtype]
        warm.inputs[spec.name].dims.extend(next(typical, 8) if d == -1 else d for d in spec.dims)
        if spec.triton_dtype in ("FP32", "FP16", "UINT8"):
            warm.inputs[spec.name].random_data = True
        else:  # random ids could fall outside an embedding; zeros are padding, valid for any model
            warm.inputs[spec.name].zero_data = True
    if opts.response_cache:
        cfg.response_cache.enable = True
    if contract.feature_names:
        # Clients read it from the model config endpoint (`parameters.feature_names`), not only the card.
        cfg.parameters["feature_names"].string_value = ",".join(contract.feature_names)
    return cfg


def _ort_tensorrt_accelerator(cfg: mc.ModelConfig, name: str, opts: ConfigOptions) -> None:
    """The onnxruntime backend's TensorRT execution accelerator, as its README writes it.

    `optimization { execution_accelerators { gpu_execution_accelerator [{ name: "tensorrt" ...}] } }`
    with `precision_mode`, `max_workspace_size_bytes`, `trt_engine_cache_enable` and
    `trt_engine_cache_path` (triton-inference-server/onnxruntime_backend, "ONNX Runtime with
    TensorRT optimization"); nodes TensorRT cannot run fall back to the CUDA provider.
    """
    acc = cfg.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
    acc.parameters["precision_mode"] = opts.ort_tensorrt.upper()
    acc.parameters["max_workspace_size_bytes"] = str(opts.ort_tensorrt_workspace_bytes)
    acc.parameters["trt_engine_cache_enable"] = "1"
    # One folder per model: engines of different models never share cache entries.
    acc.parameters["trt_engine_cache_path"] = f"{opts.ort_tensorrt_cache_dir.rstrip('/')}/{name}"


def gpu_config(
    name: str,
    contract: ServingContract,
    opts: ConfigOptions,
    tensorrt_plan: bool = False,
    *,
    backend: str | None = None,
    cc_plans: dict[str, str] | None = None,
    cpu_only: bool = False,
) -> mc.ModelConfig:
    """The GPU profile. `cc_plans` maps compute capability ("8.6") to plan file when several are built.

    `cpu_only` (an INT8 graph): the onnxruntime backend on CPU instances of the GPU server, since
    its CUDA provider runs quantized (QDQ) graphs mostly by falling back to the CPU anyway.
    """
    backend = backend or ("tensorrt" if tensorrt_plan else "onnxruntime")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if opts.ort_tensorrt != "off" and backend != "onnxruntime":
        raise ValueError(
            f"ort_tensorrt={opts.ort_tensorrt} configures the onnxruntime backend, but this model serves "
            f"with {backend}: drop --ort-tensorrt or export ONNX without a TensorRT plan (--tensorrt off)"
        )
    cfg = _common(name, contract, opts)
    if backend == "tensorrt":
        cfg.platform = "tensorrt_plan"
        files = list((cc_plans or {}).values())
        cfg.default_model_filename = files[0] if files else MODEL_FILES["tensorrt"]
        if len(files) > 1:
            # Triton picks the file named for the GPU's compute capability, else the default.
            for cc, filename in (cc_plans or {}).items():
                cfg.cc_model_filenames[cc] = filename
    elif backend == "pytorch":
        cfg.platform = "pytorch_libtorch"
        cfg.default_model_filename = MODEL_FILES["pytorch"]
    else:
        cfg.backend = "onnxruntime"
        cfg.default_model_filename = MODEL_FILES["onnxruntime"]
        if opts.ort_tensorrt != "off":
            _ort_tensorrt_accelerator(cfg, name, opts)
    if cpu_only:
        if backend != "onnxruntime":
            raise ValueError(f"a CPU-only GPU profile serves ONNX with onnxruntime, not {backend}")
        cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=opts.cpu_instances)
        cfg.parameters["intra_op_thread_count"].string_value = str(opts.ort_threads)
    else:
        cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU, count=opts.gpu_instances)
    return cfg


def local_config(
    name: str, contract: ServingContract, opts: ConfigOptions, backend: str = "onnxruntime"
) -> mc.ModelConfig:
    """The CPU profile: the Python backend runs model.onnx (ONNX Runtime) or model.pt (torch)."""
    cfg = _common(name, contract, opts)
    cfg.backend = "python"
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=opts.cpu_instances)
    if backend == "pytorch":
        cfg.parameters["torchscript_file"].string_value = MODEL_FILES["pytorch"]
    else:
        cfg.parameters["onnx_file"].string_value = MODEL_FILES["onnxruntime"]
    cfg.parameters["intra_op_threads"].string_value = str(opts.ort_threads)
    return cfg
