"""Plan records, per-capability configs, the ORT TensorRT accelerator and the refusal rules.

Configs are rendered and parsed back against Triton's `ModelConfig` schema (tritonclient's
model_config_pb2 with protobuf text_format), exactly as Triton reads them.
"""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from exporter.contract import ServingContract
from exporter.errors import TensorRTUnavailable
from exporter.parity import TF32_TOLERANCE, TOLERANCE, gpu_canary_tolerance
from exporter.plans import (
    PlanRecord,
    TensorRTBuild,
    build_from_card,
    capability_mismatch,
    plan_filename,
    server_refusal,
    tensorrt_version_mismatch,
)
from exporter.target import TARGET
from exporter.tensorrt_build import TensorRTOptions, check_builder_version
from exporter.triton_config import ConfigOptions, gpu_config, local_config
from repository.model_config import render, required_files

CONTRACT = ServingContract.table(3, ("a", "b"))


def _schema_parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def _build(*ccs: str, version: str = "10.5.0", **kw: object) -> TensorRTBuild:
    plans = [PlanRecord(file=plan_filename(cc, len(ccs) > 1), gpu="GPU", compute_capability=cc) for cc in ccs]
    return TensorRTBuild(version=version, plans=plans, **kw)  # type: ignore[arg-type]


def test_several_plans_are_named_per_capability_in_cc_model_filenames() -> None:
    cc_plans = {"8.6": plan_filename("8.6", True), "9.0": plan_filename("9.0", True)}
    cfg = _schema_parse(
        render(gpu_config("m", CONTRACT, ConfigOptions(), backend="tensorrt", cc_plans=cc_plans))
    )
    assert cfg.platform == "tensorrt_plan"
    assert dict(cfg.cc_model_filenames) == {"8.6": "model_sm86.plan", "9.0": "model_sm90.plan"}
    assert cfg.default_model_filename == "model_sm86.plan"
    assert required_files(cfg) == {"model_sm86.plan", "model_sm90.plan"}
    single = _schema_parse(
        render(gpu_config("m", CONTRACT, ConfigOptions(), backend="tensorrt", cc_plans={"8.6": "model.plan"}))
    )
    assert single.default_model_filename == "model.plan" and not single.cc_model_filenames


def test_ort_tensorrt_accelerator_is_written_as_the_onnxruntime_backend_documents() -> None:
    opts = ConfigOptions(ort_tensorrt="fp16", ort_tensorrt_cache_dir="/cache/trt/", response_cache=True)
    text = render(gpu_config("lt", CONTRACT, opts))
    cfg = _schema_parse(text)
    assert cfg.backend == "onnxruntime" and cfg.default_model_filename == "model.onnx"
    (acc,) = cfg.optimization.execution_accelerators.gpu_execution_accelerator
    assert acc.name == "tensorrt"
    assert dict(acc.parameters) == {
        "precision_mode": "FP16",
        "max_workspace_size_bytes": str(1 << 30),
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": "/cache/trt/lt",
    }
    assert 'gpu_execution_accelerator {\n      name: "tensorrt"' in text
    # the local CPU profile never carries a GPU accelerator; both profiles carry the response cache
    local = _schema_parse(render(local_config("lt", CONTRACT, opts)))
    assert not local.optimization.execution_accelerators.gpu_execution_accelerator
    assert cfg.response_cache.enable and local.response_cache.enable
    plain = _schema_parse(render(gpu_config("lt", CONTRACT, ConfigOptions())))
    assert not plain.HasField("optimization") and not plain.response_cache.enable


def test_ort_tensorrt_on_another_backend_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match="ort_tensorrt=fp16 configures the onnxruntime backend, but this model serves with tensorrt",
    ):
        gpu_config("m", CONTRACT, ConfigOptions(ort_tensorrt="fp16"), backend="tensorrt")


def test_torchscript_profiles() -> None:
    gpu = _schema_parse(render(gpu_config("m", CONTRACT, ConfigOptions(), backend="pytorch")))
    assert gpu.platform == "pytorch_libtorch" and gpu.default_model_filename == "model.pt"
    assert [o.name for o in gpu.output] == ["logits", "probabilities", "label"]  # tuple order of forward
    local = _schema_parse(render(local_config("m", CONTRACT, ConfigOptions(), backend="pytorch")))
    assert local.backend == "python" and local.parameters["torchscript_file"].string_value == "model.pt"


def test_tensorrt_version_rules() -> None:
    assert tensorrt_version_mismatch("10.5.0", "10.5.0.18", version_compatible=False) is None
    assert tensorrt_version_mismatch("10.3.0", "10.5.0.18", version_compatible=False) == (
        "the plan was built with TensorRT 10.3.0 and loads only on that version, but the server runs TensorRT "
        "10.5.0.18: rebuild it with TensorRT 10.5.0.18 (pip install 'skewserve[gpu]' pins the serving image's "
        "version) or build with --trt-version-compatible"
    )
    assert tensorrt_version_mismatch("10.3.0", "10.5.0.18", version_compatible=True) is None
    assert "runs TensorRT 10.3.0" in str(
        tensorrt_version_mismatch("10.5.0", "10.3.0", version_compatible=True)
    )
    assert "within major 10" in str(tensorrt_version_mismatch("10.5.0", "11.0.0", version_compatible=True))


def test_capability_rules() -> None:
    assert capability_mismatch(_build("8.6", "9.0"), "9.0") is None
    assert capability_mismatch(_build("8.6"), "8.0") == (
        "the version has plans for compute capability 8.6, but the server's GPU has compute capability 8.0: "
        "build on such a GPU (or with --trt-hardware-compatibility ampere_plus for GPUs of capability 8.0+)"
    )
    ampere = _build("8.6", hardware_compatibility="ampere_plus")
    assert capability_mismatch(ampere, "9.0") is None and capability_mismatch(ampere, "8.0") is None
    assert "capability 7.5" in str(capability_mismatch(ampere, "7.5"))
    with pytest.raises(ValueError, match="compute capability 'sm86' must look like 8.6"):
        capability_mismatch(ampere, "sm86")


def test_server_refusal_reads_the_target_and_names_the_fix() -> None:
    build = _build("8.6")
    assert server_refusal(build, TARGET.triton_version, None, ["8.6"]) is None
    unknown = server_refusal(build, "2.44.0", None, ["8.6"])
    assert unknown is not None and unknown.startswith(
        f"the server runs Triton 2.44.0, whose TensorRT version is not known here (the pinned target {TARGET.image}"
    )
    assert server_refusal(build, "2.44.0", "10.5.0", ["8.6"]) is None  # stated by the operator
    assert "TensorRT 10.3.0" in str(server_refusal(build, "2.44.0", "10.3.0", ["8.6"]))
    assert "pass --gpu-capability" in str(server_refusal(build, TARGET.triton_version, None, []))
    assert "capability 7.5" in str(server_refusal(build, TARGET.triton_version, None, ["8.6", "7.5"]))


def test_card_record_round_trip() -> None:
    build = _build("8.6", "9.0", version_compatible=True)
    card = {"export": {"tensorrt": build.model_dump()}}
    assert build_from_card(card) == build
    assert build_from_card({"export": {"tensorrt": None}}) is None
    assert build_from_card({"export": {"tensorrt": False}}) is None  # cards written before plan records


def test_builder_refuses_a_tensorrt_the_serving_image_cannot_load() -> None:
    check_builder_version("10.5.0", TensorRTOptions())  # the pinned version builds
    with pytest.raises(
        TensorRTUnavailable, match=r"TensorRT 10.7.0 is installed here, but the serving image "
    ):
        check_builder_version("10.7.0", TensorRTOptions())
    check_builder_version("10.3.0", TensorRTOptions(version_compatible=True))  # older, forward-compatible
    with pytest.raises(TensorRTUnavailable):
        check_builder_version("10.7.0", TensorRTOptions(version_compatible=True))


def test_gpu_canary_limits_are_stated_per_backend() -> None:
    assert gpu_canary_tolerance("tensorrt", "fp32") == TOLERANCE["fp32"]  # TF32 cleared in FP32 plans
    assert gpu_canary_tolerance("tensorrt", "fp32", tf32=True) == TF32_TOLERANCE
    assert gpu_canary_tolerance("onnxruntime", "fp32") == TF32_TOLERANCE  # ORT's CUDA provider: TF32 on
    assert gpu_canary_tolerance("onnxruntime", "fp32", ort_tensorrt="fp16") == TOLERANCE["fp16"]
    assert gpu_canary_tolerance("pytorch", "fp32") == TOLERANCE["fp32"]
    assert gpu_canary_tolerance("tensorrt", "fp16") == TOLERANCE["fp16"]
