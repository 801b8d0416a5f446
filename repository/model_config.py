"""Triton model configs as the repository holds them: parse, render, and read what they imply.

Configs are `ModelConfig` protobufs rendered to text, never hand-typed (exporter/triton_config.py
builds them). Two profiles per model: `config.pbtxt` for GPU servers and `configs/local.pbtxt` for
the local CPU server (`tritonserver --model-config-name=local`).
"""

from __future__ import annotations

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

LOCAL_PROFILE = "local"
# Triton's backend names: what a model's GPU profile runs on (repository/backend.py keeps it per model).
BACKENDS: tuple[str, ...] = ("onnxruntime", "tensorrt", "pytorch")
MODEL_FILES = {"onnxruntime": "model.onnx", "tensorrt": "model.plan", "pytorch": "model.pt"}


def render(cfg: mc.ModelConfig) -> str:
    text = text_format.MessageToString(cfg)
    parse(text)  # every config we write must parse against Triton's schema
    return text


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def required_files(cfg: mc.ModelConfig) -> set[str]:
    """Files a version folder must hold for Triton to load it with this GPU config."""
    return {cfg.default_model_filename, *cfg.cc_model_filenames.values()} - {""}


def backend_of(cfg: mc.ModelConfig) -> str:
    """Triton's backend name for a GPU config (platform names map onto their backends)."""
    by_platform = {
        "tensorrt_plan": "tensorrt",
        "pytorch_libtorch": "pytorch",
        "onnxruntime_onnx": "onnxruntime",
    }
    return cfg.backend or by_platform.get(cfg.platform, cfg.platform)


def pin_versions(config_text: str, versions: list[int]) -> str:
    """The config with its version policy naming exactly `versions`."""
    cfg = parse(config_text)
    cfg.version_policy.specific.versions[:] = sorted(versions)
    return render(cfg)


def policy_versions(config_text: str, complete: list[int]) -> list[int]:
    """What a config's version policy serves among `complete` versions (Triton's own reading)."""
    cfg = parse(config_text)
    policy = cfg.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        return list(complete)
    if policy == "specific":
        return [v for v in cfg.version_policy.specific.versions if v in complete]
    keep = cfg.version_policy.latest.num_versions if policy == "latest" else 1
    return complete[-max(keep, 1) :]
