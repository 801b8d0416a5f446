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

from gateway.config import DiscoveryConfig, GatewayConfig
from gateway.fleet.discovery_dns import DnsSource
from gateway.fleet.discovery_k8s import EndpointSliceSource
from gateway.fleet.discovery_source import DiscoveredRegion, DiscoverySource, Fleet
from gateway.task_stop import cancel_and_wait

logger = logging.getLogger(__name__)


def make_source(region: DiscoveredRegion, cfg: DiscoveryConfig) -> DiscoverySource:
    if cfg.endpointslices is not None:
        return EndpointSliceSource(region, cfg)
    return DnsSource(region, cfg)


class _RegionWatch:
    """One region's source and the task following it."""

    def __init__(self, gw: Fleet, region: str, cfg: DiscoveryConfig) -> None:
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
            await cancel_and_wait(self.task)
            self.task = None
        await self.source.close()


class Discovery:
    """Every region's discovery, owned by the gateway: started with it, stopped with it, and
    changed with the config on reload."""

    def __init__(self, gw: Fleet) -> None:
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
