"""Triton model configs, built as `ModelConfig` protobufs and rendered to text, never hand-typed.

Two profiles per model: `config.pbtxt` for GPU servers (NGC container; onnxruntime backend, or the
TensorRT plan) and `configs/local.pbtxt` for the local CPU server, selected with
`tritonserver --model-config-name=local` (Python backend running the same model.onnx).
"""

from __future__ import annotations

from google.protobuf import text_format
from pydantic import BaseModel, Field
from tritonclient.grpc import model_config_pb2 as mc

from exporter.contract import ServingContract, TensorSpec

LOCAL_PROFILE = "local"
_DTYPES = {"FP32": mc.TYPE_FP32, "FP16": mc.TYPE_FP16, "INT64": mc.TYPE_INT64}


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


def _tensors(container: object, specs: tuple[TensorSpec, ...]) -> None:
    for spec in specs:
        t = container.add()  # type: ignore[attr-defined]
        t.name = spec.name
        t.data_type = _DTYPES[spec.triton_dtype]
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
        warm.inputs[spec.name].data_type = _DTYPES[spec.triton_dtype]
        warm.inputs[spec.name].dims.extend(spec.dims)
        warm.inputs[spec.name].random_data = True
    if opts.response_cache:
        cfg.response_cache.enable = True
    return cfg


def gpu_config(
    name: str, contract: ServingContract, opts: ConfigOptions, tensorrt_plan: bool
) -> mc.ModelConfig:
    cfg = _common(name, contract, opts)
    if tensorrt_plan:
        cfg.platform = "tensorrt_plan"
        cfg.default_model_filename = "model.plan"
    else:
        cfg.backend = "onnxruntime"
        cfg.default_model_filename = "model.onnx"
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU, count=opts.gpu_instances)
    return cfg


def local_config(name: str, contract: ServingContract, opts: ConfigOptions) -> mc.ModelConfig:
    cfg = _common(name, contract, opts)
    cfg.backend = "python"
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=opts.cpu_instances)
    cfg.parameters["onnx_file"].string_value = "model.onnx"
    cfg.parameters["intra_op_threads"].string_value = str(opts.ort_threads)
    return cfg


def render(cfg: mc.ModelConfig) -> str:
    text = text_format.MessageToString(cfg)
    parse(text)  # every config we write must parse against Triton's schema
    return text


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())
