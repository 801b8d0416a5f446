"""What a TensorRT plan needs from the server that loads it, and the check that it gets it.

A serialized engine is tied to (a) the TensorRT version that built it and (b) the GPU's compute
capability (TensorRT developer guide, "Engine Compatibility"):

- by default a plan loads only on the TensorRT version that built it; built with
  `BuilderFlag.VERSION_COMPATIBLE` it also loads on later versions of the same major (the server
  must allow the embedded lean runtime: Triton's `--backend-config=tensorrt,version-compatible=true`);
- by default a plan runs only on GPUs of the compute capability it was built on; built with
  `HardwareCompatibilityLevel.AMPERE_PLUS` it runs on every GPU of capability 8.0 or later.

The exporter records these facts per plan in the model card (`PlanRecord`, `TensorRTBuild`); rollout
reads them back and refuses a server that cannot load the version, with the reason, before asking
Triton to load anything.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from exporter.target import TARGET

HardwareCompatibility = Literal["none", "ampere_plus"]
AMPERE = (8, 0)
VERSION_COMPATIBLE_BACKEND_CONFIG = "--backend-config=tensorrt,version-compatible=true"


def version_triplet(version: str) -> tuple[int, int, int]:
    """`10.5.0.18` (NGC notes) and `10.5.0` (the pip wheel's `tensorrt.__version__`) -> (10, 5, 0)."""
    parts = version.split(".")
    try:
        nums = [int("".join(ch for ch in p if ch.isdigit()) or "0") for p in parts[:3]]
    except ValueError as exc:  # pragma: no cover - the filter above leaves digits only
        raise ValueError(f"not a TensorRT version: {version!r}") from exc
    if len(parts) < 2:
        raise ValueError(f"not a TensorRT version: {version!r} (want MAJOR.MINOR[.PATCH[.BUILD]])")
    nums += [0] * (3 - len(nums))
    return nums[0], nums[1], nums[2]


def capability_tuple(capability: str) -> tuple[int, int]:
    """`8.6` -> (8, 6); the form Triton's `cc_model_filenames` keys use."""
    major, _, minor = capability.partition(".")
    if not major.isdigit() or not minor.isdigit():
        raise ValueError(f"compute capability {capability!r} must look like 8.6 (MAJOR.MINOR)")
    return int(major), int(minor)


def plan_filename(capability: str, several: bool) -> str:
    """`model.plan` for a single plan; `model_sm86.plan` per capability when several are built."""
    if not several:
        return "model.plan"
    major, minor = capability_tuple(capability)
    return f"model_sm{major}{minor}.plan"


class PlanRecord(BaseModel):
    """One built plan: its file and the GPU it was built on."""

    file: str
    gpu: str = Field(description="torch.cuda.get_device_name of the building GPU")
    compute_capability: str = Field(description="MAJOR.MINOR of the building GPU, Triton's cc key")


class TensorRTBuild(BaseModel):
    """How the version's plans were built: recorded in the model card under export.tensorrt."""

    version: str = Field(description="tensorrt.__version__ of the builder")
    target_version: str = Field(default=TARGET.tensorrt_version, description="TensorRT of the serving image")
    version_compatible: bool = False
    hardware_compatibility: HardwareCompatibility = "none"
    tf32: bool = Field(default=False, description="TF32 kernels allowed in FP32 plans (off by default)")
    plans: list[PlanRecord] = Field(default_factory=list)


def tensorrt_version_mismatch(built: str, server: str, version_compatible: bool) -> str | None:
    """None when a plan built by TensorRT `built` loads on a server running TensorRT `server`."""
    b, s = version_triplet(built), version_triplet(server)
    if not version_compatible:
        if b == s:
            return None
        return (
            f"the plan was built with TensorRT {built} and loads only on that version, but the server runs "
            f"TensorRT {server}: rebuild it with TensorRT {server} (pip install 'skewserve[gpu]' pins the "
            f"serving image's version) or build with --trt-version-compatible"
        )
    if b[0] == s[0] and s >= b:
        return None
    return (
        f"the plan is version-compatible from TensorRT {built} within major {b[0]}, but the server runs "
        f"TensorRT {server}: rebuild it with TensorRT {s[0]}.x no newer than {server}"
    )


def capability_mismatch(build: TensorRTBuild, capability: str) -> str | None:
    """None when some plan of the version runs on a GPU of `capability`."""
    cc = capability_tuple(capability)
    if build.hardware_compatibility == "ampere_plus":
        if cc >= AMPERE:
            return None
        return (
            f"the plans are hardware-compatible for Ampere and later (compute capability 8.0+), but the "
            f"server's GPU has compute capability {capability}: build on a GPU of capability {capability}"
        )
    built = sorted({p.compute_capability for p in build.plans}, key=capability_tuple)
    if capability in built:
        return None
    return (
        f"the version has plans for compute capability {', '.join(built) or 'none'}, but the server's GPU "
        f"has compute capability {capability}: build on such a GPU (or with --trt-hardware-compatibility "
        "ampere_plus for GPUs of capability 8.0+)"
    )


def tensorrt_for_triton(triton_version: str) -> str | None:
    """The TensorRT inside the Triton release a server reports, when it is the pinned target."""
    return TARGET.tensorrt_version if triton_version == TARGET.triton_version else None


def build_from_card(card: dict[str, Any]) -> TensorRTBuild | None:
    """The version's TensorRT build record, or None when it carries no plan."""
    raw = card.get("export", {}).get("tensorrt")
    if not isinstance(raw, dict) or not raw.get("plans"):
        return None
    return TensorRTBuild.model_validate(raw)


def server_refusal(
    build: TensorRTBuild,
    triton_version: str,
    server_tensorrt: str | None,
    gpu_capabilities: list[str],
) -> str | None:
    """Why a server cannot load the version's plans, or None when it can.

    `triton_version` is what the server reports (`GET /v2`); its TensorRT is known for the pinned
    image, else it must be stated (`server_tensorrt`). `gpu_capabilities` are the servers' GPUs.
    """
    tensorrt = server_tensorrt or tensorrt_for_triton(triton_version)
    if tensorrt is None:
        return (
            f"the server runs Triton {triton_version}, whose TensorRT version is not known here (the pinned "
            f"target {TARGET.image} is Triton {TARGET.triton_version} with TensorRT {TARGET.tensorrt_version}): "
            "serve with the pinned image, or state the server's TensorRT with --server-tensorrt"
        )
    reason = tensorrt_version_mismatch(build.version, tensorrt, build.version_compatible)
    if reason is not None:
        return reason
    if not gpu_capabilities:
        built = ", ".join(sorted({p.compute_capability for p in build.plans}))
        return (
            f"the version's TensorRT plans run on compute capability {built}"
            + (" and later Ampere+ GPUs" if build.hardware_compatibility == "ampere_plus" else "")
            + ", and the servers' GPUs are not known: pass --gpu-capability (e.g. 7.5 T4, 8.0 A100, 8.6 A10G, "
            "8.9 L4, 9.0 H100)"
        )
    for capability in gpu_capabilities:
        reason = capability_mismatch(build, capability)
        if reason is not None:
            return reason
    return None
