"""The gateway's protocol-independent core: fleet, routing, admission, cache, drain state.

The HTTP and gRPC fronts translate their wire formats into calls on `Gateway`; everything that
decides where a request goes or whether it is served lives here once.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from gateway.config import GatewayConfig, ServerConfig
from gateway.errors import BadRequest, NoReadyServer
from gateway.fleet.balancer import make_balancer
from gateway.fleet.cascade import Cascade
from gateway.fleet.cold_start import ColdStart
from gateway.fleet.discovery import Discovery
from gateway.fleet.dispatch import WHOLE_DEADLINE, Attempt, Dispatcher, Outcome, SequenceId
from gateway.fleet.health import HealthChecker, OutlierDetector
from gateway.fleet.router import Region, RegionRouter
from gateway.fleet.shadow import Shadow
from gateway.fleet.traffic import Traffic
from gateway.forward_headers import NEVER_FORWARDED, NEVER_FORWARDED_PREFIXES
from gateway.operations.metrics import OTHER_MODEL, GatewayMetrics
from gateway.operations.step_costs import StepCosts
from gateway.state.auth import Authenticator, Principal
from gateway.state.body_budget import BodyBudget
from gateway.state.cache import MemoryCache, RedisCache, ResponseCache
from gateway.state.coalesce import Coalescer
from gateway.state.limits import RateLimiter, client_key
from gateway.state.redis_link import RedisLink
from gateway.state.stream_slots import StreamSlots
from gateway.task_stop import cancel_all_and_wait
from gateway.upstream.grpc_relay import GrpcRelay
from gateway.upstream.server import FLEET_CHANGES, UpstreamServer

logger: Final = logging.getLogger(__name__)
T = TypeVar("T")
COLD_START_ROUNDS: Final = 3  # loads a request waits for when its model keeps being moved away
# The model this request was admitted to (set by `Gateway.admit_model` in the request's own task),
# so metric labels name only models the caller may use.

_ADMITTED: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "skewserve_admitted", default=None
)


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
        grpc_relay: GrpcRelay | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        # Upstream gRPC through the HAProxy data plane when it runs (gateway/upstream/haproxy.py).
        self.grpc_relay = grpc_relay
        self.metrics = GatewayMetrics()
        regions = [
            Region(
                r.name,
                [
                    UpstreamServer(
                        s,
                        r.name,
                        cfg.balancing.ewma_decay_s,
                        cfg.retries.connect_timeout_s,
                        clock,
                        grpc_relay,
                        grpc_over_http=cfg.listen.grpc_upstream == "http_binary",
                    )
                    for s in r.servers
                ],
                None if r.rtt_ms is None else r.rtt_ms / 1000,
            )
            for r in cfg.regions
        ]
        self.router = RegionRouter(
            cfg, regions, {r.name: make_balancer(cfg.balancing.policy) for r in regions}, clock
        )
        self.servers = self.router.servers()  # one list, shared with health: changed in place
        for server in self.servers:
            self.metrics.server_joined(server.region, server.name)
        self._leaving: set[asyncio.Task[None]] = set()  # removed servers draining, then closed
        # What config reload (gateway/reload.py) did last: shown in the fleet view.
        self.reloads: dict[str, Any] = {"applied": 0, "refused": 0, "last_refusal": ""}
        self.detector = OutlierDetector(cfg.health, on_eject=self.metrics.ejection, servers=self.servers)
        self.health = HealthChecker(self.servers, cfg.health, cfg.upstream_protocol, self.detector, clock)
        self.dispatcher = Dispatcher(cfg, self.router, self.detector, self.metrics, clock)
        self.cold_start = (
            ColdStart(cfg.cold_start, lambda: self.servers, self.health, cfg.home_region, clock)
            if cfg.cold_start
            else None
        )
        # models in canary: pinned versions, canary shares, shadow traffic (from the controller)
        self.traffic = Traffic(cfg.traffic, self.router.listed, cfg.home_region) if cfg.traffic else None
        self.shadow = Shadow(cfg.traffic, clock) if cfg.traffic else None
        if self.traffic is not None:
            self.metrics.attach_traffic(lambda: self.traffic.plans if self.traffic else {})
        self.auth = Authenticator(cfg.auth, clock)
        pattern = cfg.routing.header_forward_pattern
        self._forward_pattern = re.compile(pattern, re.IGNORECASE) if pattern else None
        self._never_forwarded = NEVER_FORWARDED | {
            cfg.routing.region_header.lower(),
            cfg.retries.timeout_header.lower(),
            *([cfg.traffic.sticky_header.lower()] if cfg.traffic else []),
        }
        # Request bytes held by both fronts together: one bound for the worker, one per caller.
        self.bodies = BodyBudget(cfg.limits.max_buffered_body_bytes, cfg.limits.per_caller_body_bytes)
        # Open streams (gRPC ModelStreamInfer, HTTP generate_stream) of both fronts together.
        self.streams = StreamSlots(cfg.limits.max_streams, cfg.limits.max_streams_per_caller)
        self.discovery = Discovery(self)  # regions with `discover`: servers from DNS or Kubernetes
        self.metrics.model_label = self.model_label
        self.redis: RedisLink | None = None
        if cfg.cache.backend == "redis":
            self.redis = RedisLink(
                cfg.cache.redis_url,
                cfg.cache.redis_timeout_s,
                cfg.cache.breaker_failures,
                cfg.cache.breaker_cooldown_s,
                clock,
                on_open=self.metrics.redis_breaker_opened.inc,
            )
        self.limiter = RateLimiter(cfg, self.redis, self.metrics, clock)
        self.cache: ResponseCache | None = None
        if cfg.cache.backend == "memory":
            self.cache = MemoryCache(
                cfg.cache.max_bytes, cfg.cache.ttl_s, clock, on_evict=self.metrics.cache_evictions.inc
            )
        elif self.redis is not None:
            self.cache = RedisCache(
                self.redis,
                cfg.cache.namespace,
                cfg.cache.hmac_secret,
                cfg.cache.ttl_s,
                cfg.cache.write_queue,
                on_tamper=self.metrics.cache_tampered.inc,
                on_drop=self.metrics.redis_writes_dropped.inc,
            )
        self._cache_all = "*" in cfg.cache.models
        self._cache_models = set(cfg.cache.models)
        self.coalescer = Coalescer(cfg.cache.max_coalescing, clock)
        self.inflight = 0
        self.draining = False  # reports not-ready; still serves
        self.refusing = False  # past the drain grace: new requests get 503
        self.metrics.attach_fleet(self.describe)
        self.step_costs = StepCosts(cfg.step_timing)
        # served names answered by a chain of models (gateway/pipeline/cascade.py)
        self.cascades = {c.name: Cascade(c, cfg.retries.connect_timeout_s, clock) for c in cfg.cascades}
        if cfg.step_timing:
            self.metrics.attach_step_costs(self.step_costs)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.health.probe_all()  # route from the first request on, not after one interval
        self.health.start()
        await self.discovery.start()
        if self.traffic is not None:
            await self.traffic.start()

    async def stop(self) -> None:
        await self.discovery.stop()
        await self.health.stop()
        if self.cold_start is not None:
            await self.cold_start.close()
        if self.traffic is not None:
            await self.traffic.close()
        if self.shadow is not None:
            await self.shadow.close()
        await cancel_all_and_wait(list(self._leaving))  # each closes its server on the way out
        for s in self.servers:
            await s.close()
        for cascade in self.cascades.values():
            await cascade.close()
        if self.grpc_relay is not None:
            await self.grpc_relay.close()
        if self.cache is not None:
            await self.cache.close()  # a RedisCache closes its link (writer and probe tasks)
        elif self.redis is not None:
            await self.redis.close()

    def ready(self) -> bool:
        now = self.clock()
        return not self.draining and any(s.available(now) for s in self.servers)

    async def drain(self, stop_serving: Callable[[], None]) -> None:
        """Not-ready first (load balancers stop sending), refuse after the grace, finish in-flight, exit."""
        if self.draining:
            return
        self.draining = True
        logger.info(
            "draining: reporting not-ready for %.1fs, then refusing new requests", self.cfg.drain.grace_s
        )
        await asyncio.sleep(self.cfg.drain.grace_s)
        self.refusing = True
        deadline = self.clock() + self.cfg.drain.timeout_s
        while (self.inflight or self.streams.open) and self.clock() < deadline:
            await asyncio.sleep(0.01)
        if self.inflight or self.streams.open:
            logger.warning(
                "drain timeout: %d request(s) and %d stream(s) still open", self.inflight, self.streams.open
            )
        stop_serving()

    # -- fleet changes (discovery, config reload) ---------------------------------------------------
    def new_server(self, cfg: ServerConfig, region: str) -> UpstreamServer:
        return UpstreamServer(
            cfg,
            region,
            self.cfg.balancing.ewma_decay_s,
            self.cfg.retries.connect_timeout_s,
            self.clock,
            self.grpc_relay,
            grpc_over_http=self.cfg.listen.grpc_upstream == "http_binary",
        )

    async def add_server(self, server: UpstreamServer) -> bool:
        """Probe `server`, then put it in routing (a request reaches it once a probe said ready).

        False (and the server closed) when its region left the fleet during the probe."""
        try:
            await self.health.probe(server)
        except asyncio.CancelledError:  # discovery reconfigured or stopped mid-probe: nothing leaks
            await server.close()
            raise
        if not self.attach_server(server):
            await server.close()
            return False
        return True

    def attach_server(self, server: UpstreamServer) -> bool:
        """Put an already-probed server in routing at once (no await); False when its region is gone."""
        region = self.router.regions.get(server.region)
        if region is None:
            return False
        region.servers.append(server)
        self.servers.append(server)  # the health checker's and outlier detector's list too
        FLEET_CHANGES.bump()
        self.metrics.server_joined(server.region, server.name)
        logger.info("server %s joined %s (ready: %s)", server.name, server.region, server.healthy)
        return True

    def remove_server(self, server: UpstreamServer) -> None:
        """No new request is routed to `server` from here on; it is closed once its in-flight
        requests and open streams finished (bounded by drain.timeout_s), so its removal fails none."""
        region = self.router.regions.get(server.region)
        if region is not None and server in region.servers:
            region.servers.remove(server)
        if server in self.servers:
            self.servers.remove(server)
        FLEET_CHANGES.bump()
        task = asyncio.get_running_loop().create_task(self._close_when_idle(server))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)
        logger.info(
            "server %s left %s: draining %d in-flight request(s)", server.name, server.region, server.inflight
        )

    async def _close_when_idle(self, server: UpstreamServer) -> None:
        try:
            # Its open streams too: closing the server closes their channel.
            deadline = self.clock() + self.cfg.drain.timeout_s
            while (server.inflight or server.open_streams) and self.clock() < deadline:
                await asyncio.sleep(0.05)
            if server.inflight or server.open_streams:
                logger.warning(
                    "%s closed with %d request(s) and %d stream(s) open",
                    server.name,
                    server.inflight,
                    server.open_streams,
                )
        finally:
            await server.close()
            self.metrics.server_left(server.region, server.name)  # its labels leave /metrics

    def add_region(self, name: str, rtt_ms: float | None) -> None:
        """An empty region joins routing; servers are added with `add_server`."""
        self.router.add_region(
            Region(name, [], None if rtt_ms is None else rtt_ms / 1000),
            make_balancer(self.cfg.balancing.policy),
        )

    def remove_region(self, name: str) -> None:
        """Take a region out of routing at once; its servers drain as removed servers do."""
        region = self.router.remove_region(name)
        for server in list(region.servers):
            self.remove_server(server)

    def leaving(self) -> int:
        """Removed servers still draining."""
        return len(self._leaving)

    # -- admission (the step itself: gateway/pipeline/admission.py) ------------------------------
    async def check_rate(self, principal: Principal | None, client: str) -> None:
        if self.rate_limited(principal):
            await self.limiter.check(principal, client)

    def rate_limited(self, principal: Principal | None) -> bool:
        """Whether a caller has a rate limit to check (a key with a rate; else per address, if set)."""
        if principal is not None:
            return principal.bucket is not None
        return self.limiter.client_rate > 0

    def admit_model(self, principal: Principal | None, model: str) -> None:
        """The model list of a caller already checked (a gRPC message names its model only once read)."""
        if model:
            self.auth.check_model(principal, model)
        _ADMITTED.set(model)

    @staticmethod
    def caller_of(principal: Principal | None, client: str) -> str:
        """Whom a request's bytes are counted against (gateway/state/body_budget.py)."""
        return f"key:{principal.name}" if principal is not None else f"client:{client_key(client)}"

    def model_label(self, model: str) -> str:
        """`model` as a metric label: itself when a server has reported it loaded and this request
        was admitted to it; otherwise OTHER_MODEL, so invented names cannot grow /metrics."""
        if _ADMITTED.get() == model and (model in self.cascades or self.router.knows_model(model)):
            return model
        return OTHER_MODEL

    def deadline(
        self,
        timeout_ms: str | None,
        timeout_us: object = None,
        model: str = "",
        call_remaining: float | None = None,
    ) -> float:
        """The request's deadline. The client's own (the tightest of the timeout header, the
        KServe/Triton `timeout` parameter in microseconds, and a gRPC call's deadline) is kept whole
        up to retries.max_timeout_s, even above the default; without one, the model's
        retries.model_timeout_s (attempts then run to it) or retries.default_timeout_s applies."""
        retries = self.cfg.retries
        asked: float | None = None
        if timeout_us is not None:
            if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us < 0:
                raise BadRequest(
                    f"the 'timeout' parameter must be a non-negative integer of microseconds, got {timeout_us!r}"
                )
            if timeout_us > 0:  # Triton reads 0 as "no timeout"
                asked = timeout_us / 1e6
        if timeout_ms:
            try:
                from_header = max(0.0, float(timeout_ms) / 1000)
            except ValueError:
                raise BadRequest(
                    f"{retries.timeout_header} must be a number of milliseconds, got {timeout_ms!r}"
                ) from None
            asked = from_header if asked is None else min(asked, from_header)
        if call_remaining is not None:
            asked = call_remaining if asked is None else min(asked, call_remaining)
        if asked is not None:
            timeout = min(asked, retries.max_timeout_s)
            WHOLE_DEADLINE.set(False)
        elif model in retries.model_timeout_s:
            timeout = retries.model_timeout_s[model]
            WHOLE_DEADLINE.set(True)
        else:
            timeout = retries.default_timeout_s
            WHOLE_DEADLINE.set(False)
        return self.clock() + timeout

    # -- sending ---------------------------------------------------------------------------------
    async def send(
        self,
        model: str,
        version: str,
        pinned: str | None,
        deadline: float,
        attempt: Attempt[T],
        sequence_id: SequenceId = None,
        hedge: bool = True,
    ) -> Outcome[T]:
        """Route and send; an unknown model goes to any server so Triton answers in its own words.

        `sequence_id` (stateful models) keeps every request of a sequence on one server, unretried;
        `hedge=False` never sends a second copy (streams).
        """
        for cold_starts in range(COLD_START_ROUNDS + 1):
            try:
                return await self.dispatcher.send(
                    model, version, pinned, deadline, attempt, sequence_id=sequence_id, hedge=hedge
                )
            except NoReadyServer:
                # a model no server holds: loaded on demand where the controller places models (again,
                # when placement moved it away between its load and this request's next try)
                if (
                    pinned is None
                    and cold_starts < COLD_START_ROUNDS
                    and self.cold_start is not None
                    and not self.cold_start.listed_anywhere(model)
                    and await self.cold_start.wait_ready(model, deadline)
                ):
                    continue
                if pinned is None and not self.router.knows_model(model):
                    return await self.dispatcher.send(model, version, None, deadline, attempt, route_any=True)
                raise
        raise AssertionError("unreachable")

    async def send_metadata(
        self, model: str, version: str, pinned: str | None, deadline: float, attempt: Attempt[T]
    ) -> Outcome[T]:
        """Health/metadata/config calls: a server with the model ready if there is one, else any
        server, so "unknown model" and "not ready" come back in Triton's own words."""
        if model:
            try:
                return await self.send(model, version, pinned, deadline, attempt)
            except NoReadyServer:
                pass
        return await self.dispatcher.send(model, version, None, deadline, attempt, route_any=True)

    def forwarded(self, name: str) -> bool:
        """Whether a client header / metadata key reaches Triton (routing.header_forward_pattern);
        keys, hop-by-hop headers, the gateway's own and the names keys bind never do."""
        if self._forward_pattern is None:
            return False
        lowered = name.lower()
        return (
            lowered not in self._never_forwarded
            and lowered not in self.auth.bound_names
            and not lowered.startswith(NEVER_FORWARDED_PREFIXES)
            and self._forward_pattern.search(name) is not None
        )

    def cache_tenant(self, principal: Principal | None) -> str:
        """The cache namespace of a caller: its key's name with cache.tenancy per_key, else shared."""
        if principal is None or (self.cfg.cache.tenancy == "shared" and not principal.headers):
            return ""
        return principal.name  # a key's bound headers may change the answer: its own entries

    def cache_enabled(self, model: str) -> bool:
        return self.cache is not None and (self._cache_all or model in self._cache_models)

    async def cache_lookup(self, key: str, model: str) -> bytes | None:
        """The stored bytes under `key` (a hit is counted), or None (the caller counts its miss)."""
        assert self.cache is not None
        stored = self.cache.get_now(key) if isinstance(self.cache, MemoryCache) else await self.cache.get(key)
        if stored is not None:
            self.cache.stats.hits += 1
            self.metrics.cache(model, hit=True)
        return stored

    async def cached(
        self,
        key: str,
        model: str,
        fetch: Callable[[], Awaitable[tuple[T, bytes | None]]],
        decode: Callable[[bytes], T],
        deadline: float | None = None,
        pinned: str | None = None,
    ) -> tuple[T, str]:
        """Serve from cache or fetch once for all identical in-flight requests; errors are never stored.

        `fetch` returns (value, bytes to store or None when the value must not be cached).
        `deadline` is this request's own: waiting behind another identical request ends there.
        `pinned` (the client's region pin) changes where the fetch goes, not what is stored: it is
        part of the coalescing key only, so a follower never shares a route it did not ask for.
        """
        assert self.cache is not None
        if pinned is not None:
            self.router.check_pin(pinned)  # a bad pin is a 400 whether or not the answer is cached
        stored = await self.cache_lookup(key, model)
        if stored is not None:
            return decode(stored), "hit"
        self.cache.stats.misses += 1
        self.metrics.cache(model, hit=False)

        async def fetch_and_store() -> T:
            value, to_store = await fetch()
            if to_store is not None and len(to_store) <= self.cfg.cache.max_entry_bytes:
                await self.cache.set(key, to_store)  # type: ignore[union-attr]
                self.metrics.cache_stored(model, len(to_store))
            return value

        def followed() -> None:  # counted when a follower joins, whatever its own outcome
            self.metrics.coalesced_request(model)

        flight = key if pinned is None else f"{key}\0pinned={pinned}"
        value, shared = await self.coalescer.run(flight, fetch_and_store, deadline, followed)
        return value, "coalesced" if shared else "miss"

    # -- introspection ---------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "home_region": self.cfg.home_region,
            "ready": self.ready(),
            "draining": self.draining,
            "inflight": self.inflight,
            "streams": self.streams.open,  # stream slots held (admission gives them back at the end)
            "retry_budget_tokens": round(self.dispatcher.budget.tokens, 2),
            "panic_routes": self.router.panic_routes,
            "ejections_refused": self.detector.ejections_refused,
            "region_order": [r.name for r in self.router.region_order()],
            "skew_index": {r.name: round(r.skew_index(), 3) for r in self.router.regions.values()},
            "cache_bytes": self.cache.size_bytes() if self.cache is not None else 0,
            "cache": None if self.cache is None else self.cache.stats.as_dict(),
            "redis": None
            if self.redis is None
            else {
                **self.redis.describe(),
                "write_queue": self.cache.queued() if isinstance(self.cache, RedisCache) else 0,
            },
            "coalescing": len(self.coalescer),
            # Request bytes held (received, inflated, being handled) and by how many callers.
            "request_bytes": {"held": self.bodies.held, "callers": self.bodies.callers()},
            "servers": [s.describe(now) for s in self.servers],
            "servers_draining": self.leaving(),
            "config_reloads": dict(self.reloads),
            "traffic": None if self.traffic is None else self.traffic.describe(),
            "cascades": {name: c.describe() for name, c in self.cascades.items()},
        }
