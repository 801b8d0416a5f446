"""The edge tier of a local stack: an edge site in front of the stack's (cloud) gateway, as
deploy/edge/ runs one (docs/cascade.md#edge-site).

Its own CPU Triton servers load every model of their repository (the small edge models; no
controller, as on a site), and its own gateway serves the cascades of its config. A cascade stage
that says `gateway: cloud` is sent to the stack's gateway, whose address is known only once it
listens; the rest of the edge gateway's config is the user's, validated at load.

Stack config:
    edge:
      repository: edge_repository   # unset: the stack's
      servers: 1
      gateway:                      # a gateway config without regions (filled in: region `edge`)
        cascades:
          - name: digits
            stages:
              - {name: edge, model: digits-small, rule: rules/digits.json}
              - {name: cloud, model: digits-big, gateway: cloud}
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.config import GatewayConfig, format_validation_error
from skewserve.errors import SkewserveError
from skewserve.gateway_process import GatewayProcess, start_gateway_process
from skewserve.triton_process import TritonFleet, TritonServerSpec

EDGE_REGION = "edge"
CLOUD = "cloud"  # a stage's `gateway: cloud`: the stack's own gateway


class EdgeTierError(SkewserveError):
    pass


class EdgeTierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repository: Path | None = Field(
        default=None, description="the edge models; unset: the stack's repository"
    )
    servers: int = Field(default=1, ge=1, description="CPU Triton servers of the edge site")
    gateway: dict[str, Any] = Field(
        default_factory=dict,
        description="the edge gateway's config without regions; a cascade stage's `gateway: cloud` is the stack's gateway",
    )


def resolve_paths(cfg: EdgeTierConfig, base: Path) -> EdgeTierConfig:
    """Relative paths of the stack file (the repository, rule files) read from its folder."""
    gw = copy.deepcopy(cfg.gateway)
    for cascade in gw.get("cascades", []):
        for stage in cascade.get("stages", []):
            if isinstance(stage.get("rule"), str) and not Path(stage["rule"]).is_absolute():
                stage["rule"] = str((base / stage["rule"]).resolve())
    repository = cfg.repository
    if repository is not None and not repository.is_absolute():
        repository = (base / repository).resolve()
    return cfg.model_copy(update={"gateway": gw, "repository": repository})


def edge_gateway_config(
    cfg: EdgeTierConfig, servers: list[dict[str, str]], cloud: tuple[str, str]
) -> dict[str, Any]:
    """The edge gateway's config: the user's, its region's servers, `gateway: cloud` filled in."""
    gw = copy.deepcopy(cfg.gateway)
    gw.setdefault("home_region", EDGE_REGION)
    gw.setdefault("listen", {}).setdefault("http_port", 0)
    gw["listen"].setdefault("grpc_port", 0)
    gw["listen"].setdefault("ops_port", 0)
    gw["regions"] = [{"name": EDGE_REGION, "servers": servers}]
    for cascade in gw.get("cascades", []):
        for stage in cascade.get("stages", []):
            if stage.get("gateway") == CLOUD:
                stage["gateway"] = {"http": cloud[0], "grpc": cloud[1]}  # loopback: no TLS, no key
    return gw


def check_edge_config(cfg: EdgeTierConfig, stack_gateway: dict[str, Any], where: str) -> None:
    """Validate the edge gateway's section now, with placeholder addresses, naming the field."""
    sends_to_cloud = any(
        stage.get("gateway") == CLOUD
        for c in cfg.gateway.get("cascades", [])
        for stage in c.get("stages", [])
    )
    needs = [
        what
        for what, on in (
            ("auth.keys", bool(stack_gateway.get("auth", {}).get("keys"))),
            ("listen.tls", bool(stack_gateway.get("listen", {}).get("tls"))),
        )
        if on
    ]
    if sends_to_cloud and needs:
        raise EdgeTierError(
            f"{where}: a stage's `gateway: cloud` reaches the stack's gateway in clear and without a key, but "
            f"its gateway section sets {' and '.join(needs)}; write the stage's gateway out in full "
            "(http, grpc, tls, ca_file, api_key_file) or drop those settings from the local stack"
        )
    placeholder = [{"name": "probe", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]
    try:
        GatewayConfig(**edge_gateway_config(cfg, placeholder, ("127.0.0.1:3", "127.0.0.1:4")))
    except ValidationError as exc:
        raise EdgeTierError(format_validation_error(exc, f"{where} (edge.gateway section)")) from exc


class EdgeTier:
    """The edge site's servers and gateway, started after the stack's gateway and stopped before it."""

    def __init__(
        self, cfg: EdgeTierConfig, repository: Path, model_config_name: str | None, log_dir: Path
    ) -> None:
        self.cfg = cfg
        self.log_dir = log_dir / "edge"
        specs = [
            TritonServerSpec(
                repository=cfg.repository or repository,
                region=EDGE_REGION,
                name=f"{EDGE_REGION}-{i}",
                model_config_name=model_config_name,
                model_control_mode="none",  # a site loads its whole repository (deploy/edge/compose.yaml)
            )
            for i in range(cfg.servers)
        ]
        self.fleet = TritonFleet(specs, self.log_dir)
        self.gateway: GatewayProcess | None = None

    def start(self, cloud: tuple[str, str], host: str, timeout_s: float) -> None:
        """Start the servers, then the gateway; the caller stops the tier if this raises."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.fleet.start()
        servers = [
            {"name": s.spec.name, "http": s.http_address, "grpc": s.grpc_address} for s in self.fleet.servers
        ]
        path = self.log_dir / "gateway.generated.yaml"
        path.write_text(yaml.safe_dump(edge_gateway_config(self.cfg, servers, cloud)))
        self.gateway = start_gateway_process(path, self.log_dir / "gateway.log", host, timeout_s)

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        self.fleet.stop()
