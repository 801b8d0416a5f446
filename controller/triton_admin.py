"""What the controller asks of one Triton server: what it has loaded, load, unload, ready, config.

What is loaded comes from the statistics API (`GET /v2/models/stats`), which lists the READY versions
from the server's memory: unlike the repository index it never lists the repository (on `s3://`, a
bucket listing per model). Load and unload are Triton's model-repository API, which the servers
restrict to callers presenting the control key (`--http-restricted-api`); only the controller has it.
"""

from __future__ import annotations

import json
from typing import Any

import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controller.errors import ControlError

CONTROL_HEADER = "skewserve-control"
READ_TIMEOUT_S = 10.0


# What only the controller may call: load, unload and the index, and the APIs that reach into the
# server's memory and files (shared memory regions, trace files, log settings), as in deploy/.
RESTRICTED_APIS = "model-repository,shared-memory,trace,logging"


def restricted_api_args(key: str) -> tuple[str, ...]:
    """tritonserver flags that close RESTRICTED_APIS to all but callers presenting `key` in the
    control header, on HTTP and gRPC alike."""
    return (
        f"--http-restricted-api={RESTRICTED_APIS}:{CONTROL_HEADER}={key}",
        f"--grpc-restricted-protocol={RESTRICTED_APIS}:{CONTROL_HEADER}={key}",
    )


def loaded_versions(stats: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for m in stats:
        if str(m.get("version", "")).isdigit():
            out.setdefault(m["name"], []).append(int(m["version"]))
    return {k: sorted(v) for k, v in out.items()}


class LoadFailed(ControlError):
    """Triton refused or failed a load; the message is Triton's reason."""


class TritonAdmin:
    def __init__(self, name: str, http_address: str, key: str, load_timeout_s: float) -> None:
        self.name = name
        self.address = http_address.removeprefix("http://")
        # Reads answer from memory: a short bound, so one hung server cannot hold up a pass; loads
        # may take the servers' start-up budget.
        self.client = httpclient.InferenceServerClient(
            self.address, connection_timeout=READ_TIMEOUT_S, network_timeout=READ_TIMEOUT_S
        )
        self.load_client = httpclient.InferenceServerClient(
            self.address, connection_timeout=READ_TIMEOUT_S, network_timeout=load_timeout_s
        )
        self.headers = {CONTROL_HEADER: key} if key else {}

    def stats(self) -> list[dict[str, Any]]:
        """Triton's statistics of every READY model version (ControlError if it cannot be asked)."""
        try:
            stats = self.client.get_inference_statistics()
        except (InferenceServerException, OSError) as exc:
            raise ControlError(f"{self.name}: cannot read the loaded models: {exc}") from exc
        return list(stats.get("model_stats", []))

    def loaded(self) -> dict[str, list[int]]:
        """READY versions per model (ControlError if the server cannot be asked)."""
        return loaded_versions(self.stats())

    def config(self, model: str) -> dict[str, Any] | None:
        try:
            config: dict[str, Any] = self.client.get_model_config(model)
        except InferenceServerException:
            return None
        except OSError as exc:
            raise ControlError(f"{self.name} did not answer for {model}'s config: {exc}") from exc
        return config

    def load(self, model: str, versions: list[int] | None = None, base: dict[str, Any] | None = None) -> None:
        """Load `model` from the repository (its configs name the served versions), or with
        `versions` as a config override (a canary): of `base` (the candidate's own config) when
        given, else of the loaded config."""
        config = None
        if versions is not None:
            loaded = base if base is not None else self.config(model)
            if loaded is None:
                raise LoadFailed(f"{model} is not loaded on {self.name}: load its served versions first")
            loaded = {**loaded, "name": model, "version_policy": {"specific": {"versions": sorted(versions)}}}
            config = json.dumps(loaded)
        try:
            self.load_client.load_model(model, headers=self.headers, config=config)
        except InferenceServerException as exc:
            raise LoadFailed(exc.message() or str(exc)) from exc
        except OSError as exc:
            raise LoadFailed(f"{self.name} did not answer the load: {exc}") from exc

    def unload(self, model: str) -> None:
        try:
            self.load_client.unload_model(model, headers=self.headers)
        except (InferenceServerException, OSError) as exc:
            raise ControlError(f"{self.name}: unloading {model} failed: {exc}") from exc

    def ready(self, model: str, version: int) -> bool:
        try:
            return bool(self.client.is_model_ready(model, str(version)))
        except (InferenceServerException, OSError):
            return False

    def close(self) -> None:
        self.client.close()
        self.load_client.close()
