"""The controller's settings, validated once where they enter (CLI, stack config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from controller.placement import PlacementConfig


class ControllerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float = Field(default=5.0, gt=0, description="seconds between reconcile passes")
    load_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="how long one model load may take on a server: the servers' start-up budget",
    )
    lease_s: float = Field(default=30.0, gt=0, description="how long a canary lease outlives its holder")
    leader_lease_s: float = Field(
        default=15.0,
        gt=0,
        description="with leader election: a dead leader is replaced within this plus a third of it",
    )
    loads_per_server: int = Field(
        default=2,
        ge=1,
        le=16,
        description="loads one server runs at once (Triton loads in --model-load-thread-count threads, 4 by default)",
    )
    retry_after_s: float = Field(
        default=30.0, gt=0, description="first wait before loading a version that failed on a server again"
    )
    absent_passes_before_unload: int = Field(
        default=3,
        ge=1,
        description="a loaded model is unloaded as gone from the repository only once this many passes "
        "in a row listed the repository successfully, non-empty, and without it",
    )
    keep_versions: int = Field(
        default=3,
        ge=1,
        description="published versions kept besides the served and canary ones; older ones are removed",
    )
    server_tensorrt: str | None = Field(
        default=None, description="TensorRT version of the servers, when not the pinned Triton image's"
    )
    gpu_capabilities: tuple[str, ...] = ()
    servers_version_compatible: bool = Field(
        default=False,
        description="the servers run with --backend-config=tensorrt,version-compatible=true; without "
        "it, versions whose TensorRT plans were built version-compatible are refused",
    )
    canary_regions: tuple[str, ...] = Field(
        default=(),
        description="regions whose servers must all pass a canary before it is promoted (with one "
        "controller per region, every region); empty: the regions of the servers this controller sees",
    )
    placement: PlacementConfig | None = Field(
        default=None,
        description="place models by demand within each server's capacity (controller/placement.py); "
        "unset: every server loads every model",
    )
