"""Send one logical request to Triton: pick a server, retry safely, hedge when asked.

Only failures before Triton produced a response are retried (connect errors, gRPC UNAVAILABLE,
timeouts), each time on a server not yet tried, within a retry budget and the request's deadline.
A request Triton rejected (bad shape, unknown input...) is never retried. The retry budget is a
token bucket in the style of Finagle's RetryBudget: every request deposits `budget_ratio` tokens,
a floor of `min_retries_per_s` accrues with time, and each retry or hedge withdraws one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from gateway.config import GatewayConfig
from gateway.errors import NoReadyServer, RetryableUpstream, UpstreamTimeout
from gateway.health import OutlierDetector
from gateway.metrics import GatewayMetrics
from gateway.router import RegionRouter, Route
from gateway.upstream import UpstreamServer

logger = logging.getLogger(__name__)
T = TypeVar("T")
Attempt = Callable[[UpstreamServer, float], Awaitable[T]]


class RetryBudget:
    def __init__(
        self, ratio: float, min_per_s: float, clock: Callable[[], float], cap: float = 100.0
    ) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.clock = clock
        self.cap = cap
        self.tokens = min(cap, max(1.0, min_per_s))
        self.last = clock()

    def deposit(self) -> None:
        now = self.clock()
        self.tokens = min(self.cap, self.tokens + self.ratio + (now - self.last) * self.min_per_s)
        self.last = now

    def try_withdraw(self) -> bool:
        now = self.clock()
        self.tokens = min(self.cap, self.tokens + (now - self.last) * self.min_per_s)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Outcome(Generic[T]):
    __slots__ = ("value", "route", "attempts")

    def __init__(self, value: T, route: Route, attempts: int) -> None:
        self.value = value
        self.route = route
        self.attempts = attempts


class Dispatcher:
    def __init__(
        self,
        cfg: GatewayConfig,
        router: RegionRouter,
        detector: OutlierDetector,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.detector = detector
        self.metrics = metrics
        self.clock = clock
        self.budget = RetryBudget(cfg.retries.budget_ratio, cfg.retries.min_retries_per_s, clock)
        self.hedged_models = set(cfg.hedging.models)

    async def _timed(self, route: Route, attempt: Attempt[T], timeout_s: float, model: str) -> T:
        server = route.server
        server.inflight += 1
        server.requests += 1
        started = self.clock()
        try:
            value = await attempt(server, timeout_s)
        except RetryableUpstream as exc:
            now = self.clock()
            if isinstance(exc, UpstreamTimeout):
                server.latency.observe(now - started, now)  # a timeout is evidence of slowness too
            self.detector.failure(server, exc.message, now)
            raise
        except asyncio.CancelledError:
            raise
        else:
            now = self.clock()
            server.latency.observe(now - started, now)
            self.detector.success(server)
            self.metrics.upstream_latency(server, now - started)
            return value
        finally:
            server.inflight -= 1

    async def send(
        self,
        model: str,
        version: str,
        pinned: str | None,
        deadline: float,
        attempt: Attempt[T],
        route_any: bool = False,
    ) -> Outcome[T]:
        """Run `attempt` on chosen servers until one answers, the budget or deadline runs out."""
        self.budget.deposit()
        tried: list[UpstreamServer] = []
        last: RetryableUpstream | None = None
        for n in range(1, self.cfg.retries.max_attempts + 1):
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise UpstreamTimeout(
                    f"deadline exceeded after {n - 1} attempt(s)" + (f": {last.message}" if last else "")
                )
            try:
                route = (
                    Route(self.router.any_server(tried), "", False)
                    if route_any
                    else self.router.route(model, version, pinned, tried)
                )
            except NoReadyServer:
                if last is not None:
                    raise last from None
                raise
            if route.spilled and n == 1:
                self.metrics.spillover(self.router.home, route.region)
            try:
                if model in self.hedged_models and not route_any:
                    value, route = await self._hedged(
                        route, attempt, remaining, model, version, pinned, tried
                    )
                else:
                    value = await self._timed(route, attempt, remaining, model)
                return Outcome(value, route, n)
            except RetryableUpstream as exc:
                last = exc
                tried.append(route.server)
                if n == self.cfg.retries.max_attempts:
                    break
                if not self.budget.try_withdraw():
                    self.metrics.retry_budget_exhausted()
                    break
                self.metrics.retry(model)
                logger.info("retrying %s on another server after: %s", model, exc.message)
        assert last is not None
        raise last

    async def _hedged(
        self,
        first: Route,
        attempt: Attempt[T],
        remaining: float,
        model: str,
        version: str,
        pinned: str | None,
        tried: list[UpstreamServer],
    ) -> tuple[T, Route]:
        """Send a second copy to another server if the first has not answered in the expected p95.

        As in Dean & Barroso, "The Tail at Scale" (2013): the expected p95 is that of the request
        class, here the lowest recent p95 among the servers, so a server that has become slow
        as a whole is hedged too (its own p95 would only say "slow is normal"). Before any server
        has 8 samples the floor `hedging.min_delay_ms` applies; the retry budget bounds the extra load.
        Returns the first successful answer and the route that produced it.
        """
        p95s = [s.latency.p95() for s in self.router.servers() if s.latency.samples >= 8]
        delay = max(self.cfg.hedging.min_delay_ms / 1000, min(p95s) if p95s else 0.0)
        started = self.clock()
        primary: asyncio.Future[T] = asyncio.ensure_future(self._timed(first, attempt, remaining, model))
        done, _ = await asyncio.wait({primary}, timeout=min(delay, remaining))
        if done:
            return primary.result(), first
        try:
            second = self.router.route(model, version, pinned, [*tried, first.server])
        except NoReadyServer:
            return await primary, first
        if not self.budget.try_withdraw():
            self.metrics.retry_budget_exhausted()
            return await primary, first
        self.metrics.hedge(model)
        backup: asyncio.Future[T] = asyncio.ensure_future(
            self._timed(second, attempt, remaining - (self.clock() - started), model)
        )
        routes = {primary: first, backup: second}
        pending: set[asyncio.Future[T]] = {primary, backup}
        error: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return task.result(), routes[task]
                    error = task.exception()
            assert error is not None
            raise error
        finally:
            for task in pending:
                task.cancel()
