"""Send one logical request to Triton: pick a server, retry safely, hedge when asked.

Only failures before Triton produced a response are retried (connect errors, gRPC UNAVAILABLE,
timeouts), each time on a server not yet tried, within a retry budget and the request's deadline.
A request Triton rejected (bad shape, unknown input...) is never retried. The retry budget is a
token bucket in the style of Finagle's RetryBudget: every request deposits `budget_ratio` tokens,
a floor of `min_retries_per_s` accrues with time, and each retry or hedge withdraws one.

Each attempt is bounded by `retries.attempt_timeout_s` within the request's deadline (Envoy's
per_try_timeout), and that bound is what the server is told (the gRPC deadline; the HTTP front
turns it into Triton's `timeout` parameter). What counts against a server's health: connection
failures, the gateway's own attempt bound expiring, and server errors (HTTP 5xx, gRPC INTERNAL /
UNAVAILABLE). A timeout caused by the client's own deadline is never the server's fault: it neither
counts toward ejection nor enters the latency EWMA, so a client cannot take servers out of rotation
or make them look fast by sending impossible deadlines. A server error's latency stays out of the
EWMA too: a fast error must not attract traffic.

Requests of a sequence (stateful models, `sequence_id`) go to one server chosen by the sequence id
and are never retried elsewhere or hedged: another server does not hold the sequence's state.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from typing import Final, Generic, TypeVar

from gateway.config import GatewayConfig
from gateway.errors import (
    GatewayError,
    InvalidVersion,
    ModelGone,
    NoReadyServer,
    RetryableUpstream,
    UpstreamRejected,
    UpstreamTimeout,
)
from gateway.fleet.health import OutlierDetector
from gateway.fleet.router import RegionRouter, Route
from gateway.operations.metrics import GatewayMetrics
from gateway.upstream.http_client import HttpResponse
from gateway.upstream.server import UpstreamServer

logger: Final = logging.getLogger(__name__)
T = TypeVar("T")
Attempt = Callable[[UpstreamServer, float], Awaitable[T]]
SequenceId = int | str | None


# Whether this request's deadline is its model's configured one (retries.model_timeout_s, a model
# known to be slow): then every attempt runs to it. Set by Gateway.deadline per request.
WHOLE_DEADLINE: Final[contextvars.ContextVar[bool]] = contextvars.ContextVar("whole_deadline", default=False)


def check_version(version: str) -> str:
    """The version as routing names it ('' = the latest): Triton reads "01" as version 1, and a
    version that is not a whole number matches none of its routes."""
    if not version:
        return ""
    stripped = version.lstrip("0") or "0"
    if not (version.isascii() and version.isdigit()) or len(stripped) > 19 or int(stripped) >= 2**63:
        raise InvalidVersion(
            f"model version {version[:40]!r} is not a version: send a whole number (e.g. 1), or none "
            "for the latest"
        )
    return stripped


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


HEDGE_MIN_SAMPLES: Final = 8


def hedge_delay(servers: Iterable[UpstreamServer], floor_s: float) -> float:
    """How long a hedged request waits before its second copy: the lowest recent p95 among the
    servers with enough samples (the request class's expected p95), never below `floor_s`."""
    p95s = [s.latency.p95() for s in servers if s.latency.samples >= HEDGE_MIN_SAMPLES]
    return max(floor_s, min(p95s) if p95s else 0.0)


_GONE_MARKERS: Final = (b"unknown model", b"has no available versions")
GONE_CHECK_TIMEOUT_S: Final = 1.0


async def _confirmed_gone(body: bytes, model: str, server: UpstreamServer, routed: bool) -> bool:
    """Triton no longer holds a model the request was routed to this server for (unloaded since: an
    eviction, a rollback): forget it there, so the request is retried on a server that has it.
    Triton's error text can repeat what the client sent (a request id, an input name), so the text
    alone decides nothing: the server is asked whether the model is ready before it is forgotten,
    unless its probe has already seen the model go since the request was routed."""
    if not model or not routed:
        return False
    head = body[:512].lower()
    if not any(marker in head for marker in _GONE_MARKERS):
        return False
    if model not in server.ready_models:
        return True
    if _says_gone(body, model):
        server.forget_model(model)  # the next probe lists it again if it is back
        return True
    path = f"/v2/models/{urllib.parse.quote(model, safe='')}/ready".encode()
    try:
        answer = await server.http_request(b"GET", path, b"", [], GONE_CHECK_TIMEOUT_S)
    except (GatewayError, OSError, asyncio.TimeoutError):
        return False  # cannot tell: the answer stands as Triton gave it
    if answer.status == 200:
        return False
    server.forget_model(model)
    return True


def _says_gone(body: bytes, model: str) -> bool:
    """Triton's own answer for a model it does not hold, from its first byte: an echo of a client's
    words comes after Triton's prefix ("[request id: ...]"), never first. The server may already
    hold the model again (unloaded and loaded since): the request was not run, so it is retried."""
    text = body.removeprefix(b'{"error":"')
    prefix = f"Request for unknown model: '{model}' ".encode()
    # "is not found": the model left the server's repository altogether, as when Triton unloads
    # everything on its way out (SIGTERM) while a request routed before the server left arrives
    return text.startswith(prefix + b"has no available versions") or text.startswith(prefix + b"is not found")


def not_ready_version(body: bytes, model: str) -> str | None:
    """The version Triton's own answer says is not ready (loading or unloading: a canary being
    loaded, a version being retired), from its first byte as `_says_gone` reads it; else None."""
    text = body.removeprefix(b'{"error":"')
    prefix = f"Request for unknown model: '{model}' version ".encode()
    if not text.startswith(prefix):
        return None
    version, _, rest = text[len(prefix) :].partition(b" ")
    return version.decode() if version.isdigit() and rest.startswith(b"is not at ready state") else None


def _gone(server: UpstreamServer, model: str) -> ModelGone:
    return ModelGone(
        f"{server.region}/{server.name} no longer holds model {model} (unloaded since its last probe)"
    )


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

    async def _timed(
        self,
        route: Route,
        attempt: Attempt[T],
        deadline: float,
        model: str,
        final: bool = False,
        routed: bool = True,
    ) -> T:
        """One attempt. It is cut at retries.attempt_timeout_s so that a hung server is retried
        elsewhere, unless it is the `final` attempt of a request that could retry (no retry would
        follow: the client's deadline is kept whole) or its model has its own deadline."""
        server = route.server
        started = self.clock()
        remaining = deadline - started
        own = self.cfg.retries.attempt_timeout_s
        # Only the gateway's own bound expiring says anything about the server; when the request's
        # deadline (the client's, or the default) is the tighter bound, a timeout is the client's.
        own_bound = own < remaining and not final and not WHOLE_DEADLINE.get()
        server.inflight += 1
        server.requests += 1
        try:
            value = await attempt(server, own if own_bound else remaining)
        except RetryableUpstream as exc:
            now = self.clock()
            if not isinstance(exc, UpstreamTimeout):
                self.detector.failure(server, exc.message, now)
            elif own_bound:
                server.latency.observe(now - started, now)  # a timeout is evidence of slowness too
                self.detector.failure(server, exc.message, now)
            raise
        except UpstreamRejected as rejected:
            if await _confirmed_gone(rejected.message.encode(), model, server, routed):
                raise _gone(server, model) from rejected
            # Triton answered: with a server error (gRPC INTERNAL...) it is evidence against the
            # server; a rejection of the client's input says nothing either way.
            if rejected.http_status >= 500:
                self.detector.failure(server, f"server error: {rejected.message}", self.clock())
            raise
        except asyncio.CancelledError:
            raise
        else:
            now = self.clock()
            if isinstance(value, HttpResponse) and value.status >= 400 and routed:
                stale = not_ready_version(value.body, model)
                if stale is not None:
                    # The health view listed the version ready here; Triton did not run the request:
                    # another server may serve it now, this one once a probe lists it again.
                    server.forget_version(model, stale)
                    raise _gone(server, model)
            if (
                isinstance(value, HttpResponse)
                and value.status in (400, 404)
                and await _confirmed_gone(value.body, model, server, routed)
            ):
                raise _gone(server, model)
            if isinstance(value, HttpResponse) and value.status >= 400:
                # An error answer's latency is not the server's latency for real work: kept out of
                # the EWMA so a fast error cannot attract traffic; 4xx is the client's, neutral.
                if value.status >= 500:
                    self.detector.failure(server, f"server error: HTTP {value.status}", now)
                return value
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
        sequence_id: SequenceId = None,
        hedge: bool = True,
    ) -> Outcome[T]:
        """Run `attempt` on chosen servers until one answers, the budget or deadline runs out.
        `hedge=False`: never a second copy (an attempt that opens a stream must run once at a time)."""
        version = check_version(version)
        self.budget.deposit()
        sticky = None if sequence_id in (None, 0, "") else str(sequence_id)
        max_attempts = 1 if sticky is not None else self.cfg.retries.max_attempts
        tried: list[UpstreamServer] = []
        last: RetryableUpstream | None = None
        for n in range(1, max_attempts + 1):
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise UpstreamTimeout(
                    f"deadline exceeded after {n - 1} attempt(s)" + (f": {last.message}" if last else "")
                )
            try:
                route = (
                    Route(self.router.any_server(tried), "", False)
                    if route_any
                    else self.router.route(model, version, pinned, tried, sticky)
                )
            except NoReadyServer:
                # a model unloaded everywhere it was routed to is a cold model now, not a failure
                if last is not None and not isinstance(last, ModelGone):
                    raise last from None
                raise
            if route.spilled and n == 1:
                self.metrics.spillover(self.router.home, route.region)
            try:
                # The last try of a request that may retry runs to its deadline: the attempts are
                # spent, or no other server could take one. (A sequence, never moved, keeps the
                # bound: a hung server fails its sequences fast and is ejected.)
                final = max_attempts > 1 and (
                    n == max_attempts
                    or (
                        not route_any
                        and not self.router.has_alternative(model, version, pinned, [*tried, route.server])
                    )
                )
                if hedge and model in self.hedged_models and not route_any and sticky is None:
                    value, route = await self._hedged(
                        route, attempt, deadline, model, version, pinned, tried, final
                    )
                else:
                    value = await self._timed(route, attempt, deadline, model, final, not route_any)
                return Outcome(value, route, n)
            except RetryableUpstream as exc:
                last = exc
                tried.append(route.server)
                if n == max_attempts or self.clock() >= deadline:
                    break  # the request's own deadline is spent: no retry could answer in time
                if not self.budget.try_withdraw():
                    self.metrics.retry_budget_exhausted()
                    break
                self.metrics.retry(model)
                logger.info("retrying %s on another server after: %s", model, exc.message)
        assert last is not None
        if self.clock() >= deadline and not isinstance(last, UpstreamTimeout):
            # The request's deadline ended the retries: that is its outcome (the client's own deadline
            # fires as well), whatever the last server said as it ran out.
            raise UpstreamTimeout(f"deadline exceeded after {n} attempt(s): {last.message}") from last
        raise last

    async def _hedged(
        self,
        first: Route,
        attempt: Attempt[T],
        deadline: float,
        model: str,
        version: str,
        pinned: str | None,
        tried: list[UpstreamServer],
        final: bool = False,
    ) -> tuple[T, Route]:
        """Send a second copy to another server if the first has not answered in the expected p95.

        As in Dean & Barroso, "The Tail at Scale" (2013): the expected p95 is that of the request
        class, here the lowest recent p95 among the servers, so a server that has become slow
        as a whole is hedged too (its own p95 would only say "slow is normal"). Before any server
        has 8 samples the floor `hedging.min_delay_ms` applies; the retry budget bounds the extra load.
        Returns the first successful answer and the route that produced it. Whatever way this
        returns or is cancelled (the client gave up), no copy is left running.
        """
        delay = hedge_delay(self.router.servers(), self.cfg.hedging.min_delay_ms / 1000)
        primary: asyncio.Future[T] = asyncio.ensure_future(
            self._timed(first, attempt, deadline, model, final)
        )
        pending: set[asyncio.Future[T]] = {primary}
        try:
            done, _ = await asyncio.wait({primary}, timeout=min(delay, deadline - self.clock()))
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
                self._timed(second, attempt, deadline, model, final)
            )
            routes = {primary: first, backup: second}
            pending = {primary, backup}
            error: BaseException | None = None
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
