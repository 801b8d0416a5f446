"""The canary check of one version on one server: load it beside the served versions, check its
answers against the exporter's reference rows (the model card), and the plans against the server."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from controller.config import ControllerConfig
from controller.errors import ControlError
from controller.triton_admin import LoadFailed, TritonAdmin
from exporter.contract import INPUT_NAME, NUMPY_DTYPES, PROBABILITIES
from repository.model_config import parse


def plan_refusal(admin: TritonAdmin, model: str, card: dict[str, Any], cfg: ControllerConfig) -> str | None:
    """Why `admin`'s server cannot load the version's TensorRT plans, or None."""
    from exporter.plans import build_from_card, server_refusal

    build = build_from_card(card)
    if build is None:
        return None
    if build.version_compatible and not cfg.servers_version_compatible:
        return (
            "its TensorRT plans are built version-compatible, which Triton loads only with "
            "--backend-config=tensorrt,version-compatible=true; start the servers with it and run the "
            "controller with --servers-version-compatible, or export without --trt-version-compatible"
        )
    loaded = admin.config(model)
    if loaded is not None and loaded.get("backend") == "python":
        return None  # the local CPU profile serves model.onnx; the plans are not loaded there
    try:
        triton_version = str(admin.client.get_server_metadata().get("version", "unknown"))
    except InferenceServerException as exc:
        return f"cannot read the server's metadata: {exc.message()}"
    except OSError as exc:
        return f"cannot read the server's metadata: {exc}"
    return server_refusal(build, triton_version, cfg.server_tensorrt, list(cfg.gpu_capabilities))


def check(
    admin: TritonAdmin,
    model: str,
    version: int,
    served: list[int],
    card: dict[str, Any],
    cfg: ControllerConfig,
    configs: CandidateConfigs | None = None,
) -> str:
    """Load and check; return a one-line summary, raise ControlError with the reason on failure.
    The caller puts the server back on the served versions when this raises."""
    refusal = plan_refusal(admin, model, card, cfg)
    if refusal is not None:
        raise ControlError(f"refused before loading: {refusal}")
    loaded = admin.config(model)
    if loaded is None:
        admin.load(model)  # the served versions first: the override edits the loaded config
        loaded = admin.config(model) or {}
    started = time.monotonic()
    admin.load(model, sorted({*served, version}), own_config(configs, loaded))
    if not admin.ready(model, version):
        raise LoadFailed(f"{model} version {version} is not ready after its load returned")
    on_gpu = runs_on_gpu(admin.config(model) or {})
    cpu_limit = float(card["canary"]["tolerance"])
    limit = float(card["canary"].get("gpu_tolerance", cpu_limit)) if on_gpu else cpu_limit
    try:
        err = canary_error(admin.client, model, version, card)
    except InferenceServerException as exc:
        raise ControlError(f"canary request failed: {exc.message()}") from exc
    except OSError as exc:
        raise ControlError(f"canary request failed: {exc}") from exc
    if err > limit:
        raise ControlError(
            f"canary for {model} version {version} differs from the exporter's reference by {err:.2e} "
            f"(limit {limit:.0e} on {'GPU' if on_gpu else 'CPU'} servers)"
        )
    return (
        f"ready in {time.monotonic() - started:.1f}s, canary max |Δp| {err:.1e} "
        f"(limit {limit:.0e}, {'GPU' if on_gpu else 'CPU'})"
    )


@dataclass(frozen=True)
class CandidateConfigs:
    """The model-level configs the candidate was published with and those the server runs now
    (the served version's), by path: the server's profile is the path whose backend it runs."""

    own: dict[str, str]
    served: dict[str, str]


def own_config(configs: CandidateConfigs | None, loaded: dict[str, Any]) -> dict[str, Any] | None:
    """The candidate's config for the profile the server runs (as Triton's JSON), or None (a
    version published before configs were kept per version: the loaded config is edited)."""
    if configs is None or not configs.own:
        return None
    running = loaded.get("backend") or loaded.get("platform")
    served = {rel: parse(text) for rel, text in configs.served.items() if rel.endswith(".pbtxt")}
    profiles = [rel for rel, cfg in served.items() if (cfg.backend or cfg.platform) == running]
    if len(profiles) != 1 or profiles[0] not in configs.own:
        return None
    own: dict[str, Any] = json_format.MessageToDict(
        parse(configs.own[profiles[0]]), preserving_proto_field_name=True
    )
    return own


def canary_inputs(card: dict[str, Any]) -> list[httpclient.InferInput]:
    """The card's recorded canary inputs as Triton inputs (format-1 cards hold one FP32 matrix)."""
    recorded = card["canary"]["inputs"]
    if recorded and not isinstance(recorded[0], dict):
        recorded = [
            {"name": INPUT_NAME, "datatype": "FP32", "shape": list(np.shape(recorded)), "data": recorded}
        ]
    out = []
    for t in recorded:
        x = np.asarray(t["data"], dtype=NUMPY_DTYPES[t["datatype"]]).reshape(t["shape"])
        inp = httpclient.InferInput(t["name"], list(x.shape), t["datatype"])
        inp.set_data_from_numpy(x, binary_data=True)
        out.append(inp)
    return out


def canary_error(
    client: httpclient.InferenceServerClient, name: str, version: int, card: dict[str, Any]
) -> float:
    result = client.infer(
        name,
        canary_inputs(card),
        model_version=str(version),
        outputs=[httpclient.InferRequestedOutput(PROBABILITIES)],
    )
    got = result.as_numpy(PROBABILITIES)
    want = np.asarray(card["canary"]["outputs"][PROBABILITIES], dtype=np.float32)
    return float(np.abs(got - want).max())


def runs_on_gpu(config: dict[str, Any]) -> bool:
    return any(group.get("kind") == "KIND_GPU" for group in config.get("instance_group", []))
