"""Discovery from DNS: the A records of a headless Service, re-resolved every `interval_s`.

A Kubernetes headless Service publishes one A record per ready pod, so a region configured with
`discover: {dns_name: triton.skewserve.svc.cluster.local}` follows its StatefulSet as it scales.
A resolver error (timeout, SERVFAIL) changes nothing; NXDOMAIN or an empty answer means no servers.
"""

from __future__ import annotations

import asyncio
import logging

import dns.asyncresolver
import dns.exception
import dns.resolver

from gateway.config import DiscoveryConfig
from gateway.fleet.discovery_source import DiscoveredRegion, DiscoverySource, Endpoint

logger = logging.getLogger(__name__)


def make_resolver(cfg: DiscoveryConfig) -> dns.asyncresolver.Resolver:
    if cfg.nameserver is None:
        return dns.asyncresolver.Resolver()  # the system's resolv.conf (cluster DNS in a pod)
    host, _, port = cfg.nameserver.rpartition(":")
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = int(port)
    return resolver


class DnsSource(DiscoverySource):
    def __init__(self, region: DiscoveredRegion, cfg: DiscoveryConfig) -> None:
        super().__init__(region, cfg)
        assert cfg.dns_name is not None
        self.name = cfg.dns_name
        self.resolver = make_resolver(cfg)
        self.resolutions = 0

    async def resolve(self) -> set[str] | None:
        """The current addresses, or None when the resolver failed (then nothing changes)."""
        try:
            answer = await self.resolver.resolve(
                self.name, "A", lifetime=min(self.cfg.interval_s, 2.0), search=False
            )
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return set()  # the name exists with no ready pod, or not at all: no servers
        except dns.exception.DNSException as exc:
            logger.warning("discovery of %s for %s failed: %s", self.name, self.region.region, exc)
            return None
        finally:
            self.resolutions += 1
        return {rr.address for rr in answer}

    async def refresh(self) -> None:
        addresses = await self.resolve()
        if addresses is not None:
            await self.region.apply({Endpoint(a, self.cfg.http_port, self.cfg.grpc_port) for a in addresses})

    async def initial(self) -> None:
        await self.refresh()

    async def follow(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.refresh()
            except Exception:  # a discovery bug must not stop re-resolution for good
                logger.exception("discovery round for %s failed", self.region.region)
