"""Real tritonservers as the controller runs them: explicit model control, no --load-model, the
model-repository API closed to all but the control key, --strict-readiness=false."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from controller.config import ControllerConfig
from controller.fleet import ControlledServer
from controller.triton_admin import TritonAdmin, restricted_api_args
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec

KEY = "test-control-key"
# Short passes; a lapsed lease lets a restarted controller resume a killed one's canary at once.
CFG = ControllerConfig(interval_s=0.2, lease_s=0.5, retry_after_s=0.2, load_timeout_s=120)


def controlled_server(
    repo: Path, name: str, log_dir: Path, prepared: PreparedTriton, **spec: object
) -> TritonServer:
    return TritonServer(
        TritonServerSpec(
            repository=repo,
            name=name,
            model_control_mode="explicit",
            extra_args=("--strict-readiness=false", *restricted_api_args(KEY)),
            **spec,  # type: ignore[arg-type]
        ),
        log_dir,
        prepared,
    )


def as_controlled(servers: list[TritonServer]) -> Callable[[], list[ControlledServer]]:
    """The servers as discovery reports them: by a stable name, at their current address."""
    return lambda: [ControlledServer(s.spec.name, s.spec.region, s.http_url) for s in list(servers)]


def loaded(server: TritonServer) -> dict[str, list[int]]:
    admin = TritonAdmin(server.spec.name, server.http_address, "", 10.0)
    try:
        return admin.loaded()
    finally:
        admin.close()
