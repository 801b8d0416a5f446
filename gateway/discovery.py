"""Triton servers found dynamically, per region: from DNS or from Kubernetes EndpointSlices.

A region configured with `discover` follows its Service as pods come and go. A source
(`discovery_dns.DnsSource`: the A records of a headless Service, re-resolved;
`discovery_k8s.EndpointSliceSource`: the ready endpoints of the Service's EndpointSlices, listed and
watched) reports the full set of endpoints it sees, and `DiscoveredRegion.apply` makes the region's
discovered servers equal to it:

- a new endpoint becomes an `UpstreamServer` that is probed at once and routed to only once its
  probe says ready (the health checker owns that from then on, as for static servers);
- an endpoint that disappeared is taken out of routing first, then closed once its in-flight
  requests finished (bounded by `drain.timeout_s`), so removals fail no request; its metric labels
  leave /metrics with it, so churning pods cannot grow label sets;
- a source error (resolver timeout, API server down) changes nothing: only an answer changes the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.config import DiscoveryConfig, GatewayConfig, ServerConfig
from gateway.upstream import UpstreamServer

if TYPE_CHECKING:
    from gateway.core import Gateway

logger = logging.getLogger(__name__)


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

    def __init__(self, gw: Gateway, region: str) -> None:
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


def make_source(region: DiscoveredRegion, cfg: DiscoveryConfig) -> DiscoverySource:
    if cfg.endpointslices is not None:
        from gateway.discovery_k8s import EndpointSliceSource

        return EndpointSliceSource(region, cfg)
    from gateway.discovery_dns import DnsSource

    return DnsSource(region, cfg)


class _RegionWatch:
    """One region's source and the task following it."""

    def __init__(self, gw: Gateway, region: str, cfg: DiscoveryConfig) -> None:
        self.cfg = cfg
        self.region = DiscoveredRegion(gw, region)
        self.source = make_source(self.region, cfg)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self.source.initial()
        except Exception:  # a source bug at start must not keep the gateway from serving
            logger.exception("first discovery round for %s failed", self.region.region)
        self.task = asyncio.get_running_loop().create_task(
            self.source.follow(), name=f"discovery-{self.region.region}"
        )

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        await self.source.close()


class Discovery:
    """Every region's discovery, owned by the gateway: started with it, stopped with it, and
    changed with the config on reload."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.watches = {
            r.name: _RegionWatch(gw, r.name, r.discover) for r in gw.cfg.regions if r.discover is not None
        }

    @property
    def regions(self) -> list[DiscoveredRegion]:
        return [w.region for w in self.watches.values()]

    async def start(self) -> None:
        await asyncio.gather(*(w.start() for w in self.watches.values()))  # route from the first request on

    async def reconfigure(self, cfg: GatewayConfig) -> None:
        """Follow `cfg`'s discover settings: unchanged regions keep their source; a changed one gets
        a new source whose first report replaces the old servers; a dropped one drains its servers."""
        wanted = {r.name: r.discover for r in cfg.regions if r.discover is not None}
        for name, watch in list(self.watches.items()):
            if wanted.get(name) != watch.cfg:
                await watch.stop()
                del self.watches[name]
                if name not in wanted:
                    watch.region.release()
                    continue
                replacement = _RegionWatch(self.gw, name, wanted[name])
                replacement.region.discovered = watch.region.discovered  # reconciled by its first report
                self.watches[name] = replacement
                await replacement.start()
        for name, discover in wanted.items():
            if name not in self.watches:
                try:
                    watch = _RegionWatch(self.gw, name, discover)
                except ValueError as exc:  # a source that cannot be built (e.g. its resolver's nameserver)
                    raise ValueError(f"region {name}: discover: {exc}") from exc
                self.watches[name] = watch
                await watch.start()

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.watches.values()))
