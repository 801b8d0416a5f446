"""What a discovery source reports into: the endpoints it sees, and the region whose servers follow
them (gateway/fleet/discovery.py runs the sources; discovery_dns.py and discovery_k8s.py are sources)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from gateway.config import DiscoveryConfig, GatewayConfig, ServerConfig
from gateway.upstream.server import UpstreamServer


class Fleet(Protocol):
    """What discovery changes: the servers of the gateway (gateway.core.Gateway), nothing else.
    A protocol rather than the class keeps discovery below the gateway (no import cycle)."""

    cfg: GatewayConfig

    def new_server(self, cfg: ServerConfig, region: str) -> UpstreamServer: ...

    async def add_server(self, server: UpstreamServer) -> bool: ...

    def remove_server(self, server: UpstreamServer) -> None: ...


@dataclass(frozen=True)
class Endpoint:
    """One server as a source sees it: where its HTTP and gRPC endpoints listen."""

    address: str
    http_port: int
    grpc_port: int

    def server_config(self, region: str) -> ServerConfig:
        host = f"[{self.address}]" if ":" in self.address else self.address  # IPv6
        return ServerConfig(
            name=f"{region}/{self.address}", http=f"{host}:{self.http_port}", grpc=f"{host}:{self.grpc_port}"
        )


class DiscoveredRegion:
    """The discovered servers of one region, kept equal to what its source last reported."""

    def __init__(self, gw: Fleet, region: str) -> None:
        self.gw = gw
        self.region = region
        self.discovered: dict[str, tuple[Endpoint, UpstreamServer]] = {}  # address -> server
        self.applied = 0

    async def apply(self, endpoints: set[Endpoint]) -> None:
        """Add the new endpoints (probed first), drain the departed ones."""
        self.applied += 1
        wanted = {e.address: e for e in endpoints}
        for address, (endpoint, server) in list(self.discovered.items()):
            if wanted.get(address) != endpoint:  # gone, or its ports changed: a new server
                del self.discovered[address]
                self.gw.remove_server(server)
        new = [e for a, e in sorted(wanted.items()) if a not in self.discovered]
        servers = [self.gw.new_server(e.server_config(self.region), self.region) for e in new]
        joined = await asyncio.gather(*(self.gw.add_server(s) for s in servers))  # probes in parallel
        for endpoint, server, ok in zip(new, servers, joined, strict=True):
            if ok:
                self.discovered[endpoint.address] = (endpoint, server)

    def release(self) -> None:
        """Drain every discovered server (discovery turned off for the region, or the region left)."""
        for _, server in self.discovered.values():
            self.gw.remove_server(server)
        self.discovered.clear()


class DiscoverySource(ABC):
    """Where a region's endpoints come from; each report is the full set of endpoints."""

    def __init__(self, region: DiscoveredRegion, cfg: DiscoveryConfig) -> None:
        self.region = region
        self.cfg = cfg

    @abstractmethod
    async def initial(self) -> None:
        """The first report, before the gateway serves (a failure is logged; `follow` retries)."""

    @abstractmethod
    async def follow(self) -> None:
        """Keep reporting changes until cancelled."""

    async def close(self) -> None:  # noqa: B027 - most sources hold nothing to release
        """Release the source's own resources (connections)."""
