"""Routing across regions: home first, spill over to the nearest region with capacity.

A request goes to the gateway's home region. It spills over, nearest region first by measured
probe round-trip time (or the configured rtt_ms), when the home region has no server with the
model (and pinned version) ready, or when all its ready servers are saturated (in-flight at the
configured bound), or when its only available servers are failing in a row (kept in rotation by
`health.max_ejection_percent`). A pinned region (header / gRPC metadata) is honoured strictly; a region that
does not exist is the client's error (400), not a missing server.

Panic routing (Envoy's panic threshold): when no region has an available server with the model,
a region where the available share of the servers holding the model is below
`health.panic_threshold_percent` routes to its ejected servers, then to its unhealthy ones,
rather than to none: a health view that has lost most of a region is trusted less than the
servers themselves, and a wrong guess costs a retry, not a refusal.

A request of a sequence (`sticky` key) goes to the server of its region chosen by rendezvous
hashing (Thaler & Ravishankar 1998) of the key over the servers with the model, so every request
of a sequence lands on the same server and only the sequences of a server that leaves move.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.errors import BadRequest, NoReadyServer
from gateway.fleet.balancer import Balancer
from gateway.fleet.model_index import ModelIndex
from gateway.upstream.server import FLEET_CHANGES, PROBE_RTT_SAMPLES, UpstreamServer


@dataclass
class Region:
    name: str
    servers: list[UpstreamServer]
    fixed_rtt_s: float | None = None

    def rtt_s(self) -> float:
        if self.fixed_rtt_s is not None:
            return self.fixed_rtt_s
        measured = [s.probe_rtt.mean for s in self.servers if s.probe_rtt.samples]
        return min(measured) if measured else float("inf")

    def skew_index(self) -> float:
        """max/mean in-flight across the region's servers (1.0 = perfectly even; 0 when idle)."""
        loads = [s.inflight for s in self.servers] or [0]  # a discovered region may be empty
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 0.0


class Route:
    """Where a request goes. A plain class: a dataclass's `__init__` runs interpreted even compiled."""

    __slots__ = ("server", "region", "spilled")

    def __init__(self, server: UpstreamServer, region: str, spilled: bool) -> None:
        self.server = server
        self.region = region
        self.spilled = spilled


class RegionRouter:
    def __init__(
        self,
        cfg: GatewayConfig,
        regions: list[Region],
        balancers: dict[str, Balancer],
        clock: Callable[[], float],
    ) -> None:
        self.home = cfg.home_region
        self.max_inflight = cfg.routing.max_inflight_per_server
        self.panic_threshold = cfg.health.panic_threshold_percent
        self.failing_after = cfg.health.eject_after_failures
        self.panic_routes = 0
        self.regions = {r.name: r for r in regions}
        self.balancers = balancers
        self.clock = clock
        self._index = ModelIndex()
        # The region order as of these counts (FLEET_CHANGES, PROBE_RTT_SAMPLES): -1, never computed.
        self._order: list[Region] = []
        self._order_fleet = -1
        self._order_rtt = -1

    def servers(self) -> list[UpstreamServer]:
        return [s for r in self.regions.values() for s in r.servers]

    def index(self) -> ModelIndex:
        """Which servers hold which model, current with the fleet (rebuilt only after a change)."""
        index = self._index
        if index.stale():
            index.build((r.name, r.servers) for r in self.regions.values())
        return index

    # -- fleet changes: each is one synchronous step, so no request sees a half-made change -----
    def add_region(self, region: Region, balancer: Balancer) -> None:
        self.balancers[region.name] = balancer
        self.regions[region.name] = region
        FLEET_CHANGES.bump()

    def remove_region(self, name: str) -> Region:
        """Take a region out of routing (its servers with it); never the home region."""
        if name == self.home:
            raise ValueError(f"region {name!r} is the home region: set another home_region first")
        region = self.regions.pop(name)
        self.balancers.pop(name, None)
        FLEET_CHANGES.bump()
        return region

    def set_home(self, name: str) -> None:
        if name not in self.regions:
            raise ValueError(f"home region {name!r} is not one of the regions {sorted(self.regions)}")
        self.home = name
        FLEET_CHANGES.bump()

    def region_order(self) -> list[Region]:
        """Home, then the others nearest first. Kept between requests (a region's measured RTT is a
        walk of its servers) until a probe's sample or a fleet change; callers must not change it."""
        if self._order_fleet != FLEET_CHANGES.count or self._order_rtt != PROBE_RTT_SAMPLES.count:
            self._order_fleet, self._order_rtt = FLEET_CHANGES.count, PROBE_RTT_SAMPLES.count
            home = self.regions[self.home]
            others = sorted(
                (r for r in self.regions.values() if r.name != self.home), key=lambda r: r.rtt_s()
            )
            self._order = [home, *others]
        return self._order

    def check_pin(self, pinned: str) -> Region:
        """The region a client pinned; BadRequest when it does not exist (checked before any cache)."""
        region = self.regions.get(pinned)
        if region is None:
            raise BadRequest(f"pinned region {pinned!r} does not exist; regions are {sorted(self.regions)}")
        return region

    def route(
        self,
        model: str,
        version: str,
        pinned: str | None = None,
        exclude: Collection[UpstreamServer] = (),
        sticky: str | None = None,
    ) -> Route:
        now = self.clock()
        if pinned is not None:
            order = [self.check_pin(pinned)]
        else:
            order = self.region_order()
        fallback: tuple[Region, list[UpstreamServer]] | None = None
        failing: tuple[Region, list[UpstreamServer]] | None = None
        index = self.index()
        for region in order:
            ready = [
                s
                for s in index.holders(region.name, model)
                if s not in exclude and s.available(now) and s.has_model(model, version)
            ]
            if not ready:
                continue
            if sticky is not None:  # a sequence stays on its server whatever the load
                return self._route(region, rendezvous(sticky, ready), pinned)
            # Servers failing in a row but kept in rotation by max_ejection_percent: a region with
            # nothing else is passed over like a saturated one, so requests spill over rather than
            # each spending a retry there.
            working = [s for s in ready if s.consecutive_failures < self.failing_after]
            if not working:
                if failing is None:
                    failing = (region, ready)
                continue
            open_ = [s for s in working if s.inflight < self.max_inflight]
            if open_:
                return self._route(region, self.balancers[region.name].pick(open_), pinned)
            if fallback is None:
                fallback = (region, working)
        if fallback is not None:  # everyone saturated: queue at the nearest region with the model
            region, ready = fallback
            return self._route(region, min(ready, key=lambda s: s.inflight), pinned)
        if failing is not None:  # only failing servers anywhere: they are still the best guess
            region, ready = failing
            return self._route(region, self.balancers[region.name].pick(ready), pinned)
        panic = self._panic_route(index, order, model, version, pinned, exclude, sticky, now)
        if panic is not None:
            return panic
        where = f"region {pinned!r}" if pinned else "any region"
        what = f"{model!r} version {version}" if version else repr(model)
        raise NoReadyServer(f"no server in {where} has model {what} ready")

    def has_alternative(
        self, model: str, version: str, pinned: str | None, exclude: Collection[UpstreamServer]
    ) -> bool:
        """Whether a retry could go anywhere: a server outside `exclude` available with the model
        (in the pinned region, or any). Reads state only."""
        now = self.clock()
        regions = [self.check_pin(pinned)] if pinned is not None else self.region_order()
        index = self.index()
        return any(
            s not in exclude and s.available(now) and s.has_model(model, version)
            for region in regions
            for s in index.holders(region.name, model)
        )

    def _route(self, region: Region, server: UpstreamServer, pinned: str | None) -> Route:
        return Route(server, region.name, region.name != self.home and pinned is None)

    def _panic_route(
        self,
        index: ModelIndex,
        order: list[Region],
        model: str,
        version: str,
        pinned: str | None,
        exclude: Collection[UpstreamServer],
        sticky: str | None,
        now: float,
    ) -> Route | None:
        """No region has an available server: route within the first region in panic, if any."""
        if self.panic_threshold <= 0:
            return None
        for region in order:
            holding = [s for s in index.holders(region.name, model) if s.has_model(model, version)]
            available = sum(1 for s in holding if s.available(now))
            if not holding or available * 100 >= self.panic_threshold * len(holding):
                continue
            candidates = [s for s in holding if s not in exclude]
            # Ejected by passive health but answering probes first; then those failing probes.
            candidates = [s for s in candidates if s.healthy] or candidates
            if not candidates:
                continue
            self.panic_routes += 1
            server = (
                rendezvous(sticky, candidates)
                if sticky is not None
                else self.balancers[region.name].pick(candidates)
            )
            return self._route(region, server, pinned)
        return None

    def any_server(self, exclude: Collection[UpstreamServer] = ()) -> UpstreamServer:
        """A reachable server regardless of models (metadata, and Triton's own unknown-model errors)."""
        now = self.clock()
        for region in self.region_order():
            for s in region.servers:
                if s not in exclude and s.available(now):
                    return s
        raise NoReadyServer("no Triton server is ready in any region")

    def knows_model(self, model: str) -> bool:
        """Some server has held `model` (so an error for it is not "unknown model")."""
        return self.index().known(model)

    def latest_version(self, model: str) -> str:
        """The highest version ready anywhere: what an unpinned request will be served by."""
        return self.index().latest(model)

    def listed(self, model: str, version: str) -> bool:
        """Some server has `version` of `model` ready, as last probed (healthy or not)."""
        return self.index().listed(model, version)


def rendezvous(key: str, servers: Sequence[UpstreamServer]) -> UpstreamServer:
    """The server with the highest hash of (key, server name): stable as servers come and go."""

    def weight(s: UpstreamServer) -> bytes:
        return hashlib.blake2b(f"{key}\x00{s.name}".encode(), digest_size=8).digest()

    return max(servers, key=weight)
