"""Roll a published version onto running Triton servers (explicit model-control mode), one by one.

Per server: ask it to (re)load the model through the repository API, wait for the version to be
ready, run the canary rows stored in the version's model card and compare with the exporter's
reference outputs, then move on. On any failure the server is reloaded with the versions it served
before (a config override pinning them), and the rollout stops with the server and Triton's reason.
While a model reloads, Triton keeps serving the versions already loaded, so clients see no error.

Before any server is touched, a version that carries TensorRT plans is checked against every server
that will load it with the GPU profile: the plans' TensorRT version (model card) against the
server's (its reported Triton release mapped through the pinned target, or --server-tensorrt), and
the plans' compute capabilities against the servers' GPUs (--gpu-capability). A mismatch refuses
the rollout with the reason; Triton would otherwise fail the load on every server in turn.
The canary limit depends on where the server runs the model: the card states one for CPU servers
(the exporter's own runtime) and one for GPU servers (TF32, FP16 accelerators; exporter/parity.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from exporter.contract import INPUT_NAME, NUMPY_DTYPES, PROBABILITIES
from exporter.errors import PublishError, RolloutError
from exporter.object_store import ObjectRepository, is_object_store_url, read_card
from exporter.plans import build_from_card, server_refusal
from exporter.publish import CARD

logger = logging.getLogger(__name__)


@dataclass
class ServerRollout:
    server: str
    previous_versions: list[str]
    ready_s: float
    canary_max_abs_error: float
    canary_limit: float = 0.0
    gpu: bool = False


def _ready_versions(client: httpclient.InferenceServerClient, name: str) -> list[str]:
    index = client.get_model_repository_index()
    return sorted(
        (
            m["version"]
            for m in index
            if m.get("name") == name and m.get("state") == "READY" and m.get("version")
        ),
        key=int,
    )


def _canary_inputs(card: dict[str, Any]) -> list[httpclient.InferInput]:
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


def _canary(client: httpclient.InferenceServerClient, name: str, version: int, card: dict[str, Any]) -> float:
    result = client.infer(
        name,
        _canary_inputs(card),
        model_version=str(version),
        outputs=[httpclient.InferRequestedOutput(PROBABILITIES)],
    )
    got = result.as_numpy(PROBABILITIES)
    want = np.asarray(card["canary"]["outputs"][PROBABILITIES], dtype=np.float32)
    return float(np.abs(got - want).max())


def _loaded_config(client: httpclient.InferenceServerClient, name: str) -> dict[str, Any] | None:
    """The config a server has loaded `name` with (which profile it serves), or None if not loaded."""
    try:
        config: dict[str, Any] = client.get_model_config(name)
    except InferenceServerException:
        return None
    return config


def _runs_on_gpu(config: dict[str, Any]) -> bool:
    return any(group.get("kind") == "KIND_GPU" for group in config.get("instance_group", []))


def _check_plans(
    servers: list[str],
    name: str,
    version: int,
    card: dict[str, Any],
    server_tensorrt: str | None,
    gpu_capabilities: list[str],
) -> None:
    """Refuse, before loading anything, a plan version some server could not load."""
    build = build_from_card(card)
    if build is None:
        return
    for server in servers:
        client = httpclient.InferenceServerClient(server.removeprefix("http://"), connection_timeout=10.0)
        try:
            loaded = _loaded_config(client, name)
            if loaded is not None and loaded.get("backend") == "python":
                continue  # the local CPU profile serves model.onnx; the plans are not loaded there
            triton_version = str(client.get_server_metadata().get("version", "unknown"))
        except InferenceServerException as exc:
            raise RolloutError(f"{server}: cannot read the server's metadata: {exc.message()}") from exc
        reason = server_refusal(build, triton_version, server_tensorrt, gpu_capabilities)
        if reason is not None:
            raise RolloutError(
                f"{server}: refusing to roll out {name} version {version}, the server cannot load its "
                f"TensorRT plans: {reason}; nothing was loaded"
            )


def _rollback(client: httpclient.InferenceServerClient, name: str, previous: list[str]) -> str:
    if not previous:
        client.unload_model(name)
        return "unloaded (no earlier version was serving)"
    config = client.get_model_config(name)
    config["version_policy"] = {"specific": {"versions": [int(v) for v in previous]}}
    client.load_model(name, config=json.dumps(config))
    return f"pinned back to version(s) {', '.join(previous)}"


def _published_card(repo: Path | str, name: str, version: int) -> dict[str, Any]:
    """The version's model card from a disk repository or an `s3://` one (complete versions only)."""
    if is_object_store_url(repo):
        try:
            return read_card(ObjectRepository.parse(str(repo)), name, version)
        except PublishError as exc:
            raise RolloutError(str(exc)) from exc
    card_path = Path(repo) / name / str(version) / CARD
    if not card_path.is_file():
        raise RolloutError(
            f"{name} version {version} is not published in {repo} (no {CARD}); export it first"
        )
    card: dict[str, Any] = json.loads(card_path.read_text())
    return card


def rollout(
    name: str,
    version: int,
    servers: list[str],
    repo: Path | str,
    ready_timeout_s: float = 60.0,
    server_tensorrt: str | None = None,
    gpu_capabilities: list[str] | None = None,
) -> list[ServerRollout]:
    """Load `version` of `name` on each server in turn; raise RolloutError after rolling back a failure."""
    card = _published_card(repo, name, version)
    _check_plans(servers, name, version, card, server_tensorrt, gpu_capabilities or [])
    cpu_limit = float(card["canary"]["tolerance"])
    gpu_limit = float(card["canary"].get("gpu_tolerance", cpu_limit))
    done: list[ServerRollout] = []
    for server in servers:
        address = server.removeprefix("http://")
        client = httpclient.InferenceServerClient(address, connection_timeout=10.0, network_timeout=120.0)
        try:
            previous = _ready_versions(client, name)
        except InferenceServerException as exc:
            raise RolloutError(f"{server}: cannot read the repository index: {exc.message()}") from exc
        started = time.monotonic()
        try:
            client.load_model(name)
            deadline = started + ready_timeout_s
            while not client.is_model_ready(name, str(version)):
                if time.monotonic() > deadline:
                    raise RolloutError(
                        f"{server}: {name} version {version} not ready after {ready_timeout_s:.0f}s"
                    )
                time.sleep(0.1)
            ready_s = time.monotonic() - started
            on_gpu = _runs_on_gpu(_loaded_config(client, name) or {})
            limit = gpu_limit if on_gpu else cpu_limit
            err = _canary(client, name, version, card)
            if err > limit:
                raise RolloutError(
                    f"{server}: canary for {name} version {version} differs from the exporter's reference by "
                    f"{err:.2e} (limit {limit:.0e} on {'GPU' if on_gpu else 'CPU'} servers)"
                )
        except (RolloutError, InferenceServerException) as exc:
            reason = exc.message() if isinstance(exc, InferenceServerException) else str(exc)
            try:
                action = _rollback(client, name, previous)
            except InferenceServerException as rb:
                action = f"rollback failed too: {rb.message()}"
            prefix = "" if reason.startswith(server) else f"{server}: "
            raise RolloutError(f"{prefix}{reason}; {action}") from exc
        logger.info(
            "%s: %s version %d ready in %.1fs, canary max |Δp| %.1e", server, name, version, ready_s, err
        )
        done.append(ServerRollout(server, previous, ready_s, err, limit, on_gpu))
    return done
