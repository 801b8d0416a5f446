"""Triton servers discovered from DNS: the A records of a headless Service, re-resolved.

A Kubernetes headless Service publishes one A record per ready pod, so a region configured with
`discover: {dns_name: triton.skewserve.svc.cluster.local}` follows its StatefulSet as it scales:

- a new address becomes an `UpstreamServer` that is probed at once and routed to only once its
  probe says ready (the health checker owns that from then on, as for static servers);
- an address that disappeared is taken out of routing first, then closed once its in-flight
  requests finished (bounded by `drain.timeout_s`), so removals fail no request;
- a resolver error (timeout, SERVFAIL) changes nothing: only an answer changes the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import dns.asyncresolver
import dns.exception
import dns.resolver

from gateway.config import DiscoveryConfig, ServerConfig
from gateway.upstream import UpstreamServer

if TYPE_CHECKING:
    from gateway.core import Gateway

logger = logging.getLogger(__name__)


def make_resolver(cfg: DiscoveryConfig) -> dns.asyncresolver.Resolver:
    if cfg.nameserver is None:
        return dns.asyncresolver.Resolver()  # the system's resolv.conf (cluster DNS in a pod)
    host, _, port = cfg.nameserver.rpartition(":")
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = int(port)
    return resolver


class RegionDiscovery:
    """Keeps the discovered servers of one region equal to the A records of its DNS name."""

    def __init__(self, gw: Gateway, region: str, cfg: DiscoveryConfig) -> None:
        self.gw = gw
        self.region = region
        self.cfg = cfg
        self.resolver = make_resolver(cfg)
        self.discovered: dict[str, UpstreamServer] = {}  # address -> server
        self.resolutions = 0
        self._closing: set[asyncio.Task[None]] = set()

    async def resolve(self) -> set[str] | None:
        """The current addresses, or None when the resolver failed (then nothing changes)."""
        try:
            answer = await self.resolver.resolve(
                self.cfg.dns_name, "A", lifetime=min(self.cfg.interval_s, 2.0), search=False
            )
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return set()  # the name exists with no ready pod, or not at all: no servers
        except dns.exception.DNSException as exc:
            logger.warning("discovery of %s for %s failed: %s", self.cfg.dns_name, self.region, exc)
            return None
        return {rr.address for rr in answer}

    async def refresh(self) -> None:
        addresses = await self.resolve()
        self.resolutions += 1
        if addresses is None:
            return
        region = self.gw.router.regions[self.region]
        for address in sorted(addresses - self.discovered.keys()):
            server = UpstreamServer(
                ServerConfig(
                    name=f"{self.region}/{address}",
                    http=f"{address}:{self.cfg.http_port}",
                    grpc=f"{address}:{self.cfg.grpc_port}",
                ),
                self.region,
                self.gw.cfg.balancing.ewma_decay_s,
                self.gw.cfg.retries.connect_timeout_s,
                self.gw.clock,
            )
            await self.gw.health.probe(server)  # routable only once a probe said ready
            self.discovered[address] = server
            region.servers.append(server)
            self.gw.servers.append(server)  # the health checker's list too
            logger.info("discovered %s in %s (ready: %s)", address, self.region, server.healthy)
        for address in sorted(self.discovered.keys() - addresses):
            server = self.discovered.pop(address)
            region.servers.remove(server)  # no new request is routed to it from here on
            self.gw.servers.remove(server)
            task = asyncio.get_running_loop().create_task(self._close_when_idle(server))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            logger.info("%s left %s: draining %d in-flight request(s)", address, self.region, server.inflight)

    async def _close_when_idle(self, server: UpstreamServer) -> None:
        deadline = self.gw.clock() + self.gw.cfg.drain.timeout_s
        while server.inflight and self.gw.clock() < deadline:
            await asyncio.sleep(0.05)
        await server.close()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.refresh()
            except Exception:  # a discovery bug must not stop re-resolution for good
                logger.exception("discovery round for %s failed", self.region)

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)


class Discovery:
    """Every region's DNS discovery, owned by the gateway: started with it, stopped with it."""

    def __init__(self, gw: Gateway) -> None:
        self.regions = [RegionDiscovery(gw, r.name, r.discover) for r in gw.cfg.regions if r.discover]
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await asyncio.gather(*(r.refresh() for r in self.regions))  # route from the first request on
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(r.run(), name=f"discovery-{r.region}") for r in self.regions]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for r in self.regions:
            await r.close()
