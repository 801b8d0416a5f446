"""The servers the controller reconciles: a gateway config's static servers plus whatever its
regions' discovery (DNS, Kubernetes EndpointSlices) reports, through the gateway's own sources."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from gateway.config import ConfigError, GatewayConfig, RegionConfig, ServerConfig

if TYPE_CHECKING:
    from gateway.upstream.server import UpstreamServer


@dataclass(frozen=True)
class FleetSpec:
    """The regions of a gateway config: all the controller reads of it."""

    regions: list[RegionConfig]


def fleet_config(path: Path) -> FleetSpec:
    """The servers of a gateway config (static and discovered regions), and nothing else of it: the
    controller holds none of the gateway's secrets (cache HMAC, API keys), which the full config
    requires, nor its environment. ConfigError names what is wrong."""
    from pydantic import ValidationError

    from gateway.config import _read_file, format_validation_error

    try:
        data = _read_file(Path(path))
        regions = [RegionConfig.model_validate(r) for r in data.get("regions") or []]
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"{path} (regions)")) from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not regions:
        raise ConfigError(f"{path} names no regions: the controller finds its servers there")
    return FleetSpec(regions)


@dataclass(frozen=True)
class ControlledServer:
    name: str  # region/name, as the gateway names it
    region: str
    http: str


class ServerSet:
    """Implements gateway.fleet.discovery_source.Fleet, keeping only names and addresses."""

    def __init__(self, fleet: FleetSpec) -> None:
        # discovery reads `cfg.regions` only (gateway/fleet/discovery.py)
        self.cfg = cast(GatewayConfig, fleet)
        cfg = fleet
        self._servers: dict[str, ControlledServer] = {}
        for region in cfg.regions:
            for s in region.servers:
                server = ControlledServer(f"{region.name}/{s.name}", region.name, s.http)
                self._servers[server.name] = server
        self.discovery: object | None = None

    def new_server(self, cfg: ServerConfig, region: str) -> UpstreamServer:
        return cast("UpstreamServer", ControlledServer(cfg.name, region, cfg.http))

    async def add_server(self, server: UpstreamServer) -> bool:
        s = cast(ControlledServer, server)
        self._servers[s.name] = s
        return True

    def remove_server(self, server: UpstreamServer) -> None:
        self._servers.pop(cast(ControlledServer, server).name, None)

    def snapshot(self) -> list[ControlledServer]:
        return sorted(self._servers.values(), key=lambda s: s.name)

    async def start(self) -> None:
        from gateway.fleet.discovery import Discovery

        discovery = Discovery(self)
        self.discovery = discovery
        await discovery.start()

    async def stop(self) -> None:
        from gateway.fleet.discovery import Discovery

        if isinstance(self.discovery, Discovery):
            await self.discovery.stop()
