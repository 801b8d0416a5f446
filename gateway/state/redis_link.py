"""One guarded connection to Redis for the cache and the shared rate limits.

Redis is trusted but can fail, hang or slow down; whatever it does, requests fail open (to Triton,
or to the local rate buckets) at the cost of at most `redis_timeout_s` each until the circuit
breaker opens. Open, the breaker skips Redis outright; after `breaker_cooldown_s` a background
PING (never a client's request) probes it and closes the breaker when it answers. Failures are
logged at most once per interval, so a dead Redis cannot turn into a log storm.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from gateway.task_stop import cancel_and_wait

logger = logging.getLogger(__name__)
T = TypeVar("T")
BreakerState = Literal["closed", "open", "half_open"]


class RedisUnavailable(Exception):
    """Redis failed, timed out, or the breaker is open: the caller falls back."""


class CircuitBreaker:
    """Closed -> open after `failures` consecutive failures -> half-open (one probe) after `cooldown_s`.

    The clock is injectable so tests can move time (Ray Serve's `circuit_breaker.py` reads `_now()`).
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state: BreakerState = "closed"
        self.consecutive = 0
        self.opened_at = 0.0
        self.opened = 0  # closed -> open transitions

    def allows(self) -> bool:
        """True when requests may use Redis (only while closed)."""
        return self.state == "closed"

    def probe_due(self) -> bool:
        """True once per cool-down: the caller probes and reports the outcome (moves to half-open)."""
        if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
            self.state = "half_open"
            return True
        return False

    def success(self) -> bool:
        """Record a success; True when it closed an open or half-open breaker."""
        self.consecutive = 0
        if self.state != "closed":
            self.state = "closed"
            return True
        return False

    def failure(self) -> bool:
        """Record a failure; True when it opened a closed breaker."""
        if self.state == "half_open":  # the probe failed: another full cool-down
            self.state = "open"
            self.opened_at = self.clock()
            return False
        self.consecutive += 1
        if self.state == "closed" and self.consecutive >= self.threshold:
            self.state = "open"
            self.opened_at = self.clock()
            self.opened += 1
            return True
        return False


class ThrottledLog:
    """At most one record per `interval_s` per kind; the next one says how many were suppressed."""

    def __init__(
        self, log: logging.Logger, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: Any) -> bool:
        return self.emit(logging.WARNING, kind, msg, *args)

    def error(self, kind: str, msg: str, *args: Any) -> bool:
        return self.emit(logging.ERROR, kind, msg, *args)

    def emit(self, level: int, kind: str, msg: str, *args: Any) -> bool:
        """Log at `level` unless `kind` was logged within the interval; True when it was logged."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += " (%d similar message(s) suppressed in the last %.0fs)"
            args = (*args, suppressed, self.interval_s)
        self.log.log(level, msg, *args)
        return True


class RedisLink:
    """A redis.asyncio client behind a circuit breaker, with an owned background probe task."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        failures: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        # No client-side retries: redis-py's default retries a timed-out call with back-off, which
        # multiplies what one request pays; the breaker decides when to try Redis again.
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self.timeout_s = timeout_s
        self.breaker = CircuitBreaker(failures, cooldown_s, clock)
        self.on_open = on_open
        self.log = ThrottledLog(logger, clock=clock)
        self._probe: asyncio.Task[None] | None = None

    def available(self) -> bool:
        """Whether to try Redis now; starts the background probe when the cool-down has passed."""
        if self.breaker.allows():
            return True
        if self.breaker.probe_due():
            self._probe = asyncio.get_running_loop().create_task(self._run_probe())
        return False

    async def call(self, what: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run `fn(client)`; RedisUnavailable when the breaker is open or the call fails."""
        if not self.available():
            raise RedisUnavailable("redis circuit breaker is open")
        try:
            result = await asyncio.wait_for(fn(self.client), self.timeout_s * 2)
        except Exception as exc:  # any failure of Redis or its client fails open, never the request
            self._failed(what, exc)
            raise RedisUnavailable(f"redis {what} failed: {exc}") from exc
        self._succeeded()
        return result

    def _failed(self, what: str, exc: BaseException) -> None:
        self.log.warning(
            f"redis-{what}", "redis %s failed (%s: %s); failing open", what, type(exc).__name__, exc
        )
        if self.breaker.failure():
            logger.warning(
                "redis circuit breaker opened after %d consecutive failures; skipping redis for %.1fs",
                self.breaker.threshold,
                self.breaker.cooldown_s,
            )
            if self.on_open:
                self.on_open()

    def _succeeded(self) -> None:
        if self.breaker.success():
            logger.info("redis at %s answers again; circuit breaker closed", self._safe_url())

    async def _run_probe(self) -> None:
        try:
            await asyncio.wait_for(self.client.ping(), self.timeout_s * 2)
        except Exception as exc:  # whatever Redis or its client raised, the probe failed
            self.breaker.failure()
            self.log.warning(
                "redis-probe", "redis probe failed (%s: %s); breaker stays open", type(exc).__name__, exc
            )
        else:
            self._succeeded()
        finally:
            if self.breaker.state == "half_open":  # cancelled mid-probe: never stay half-open
                self.breaker.failure()

    def _safe_url(self) -> str:
        return self.url.rsplit("@", 1)[-1]  # never log a password carried in the URL

    def describe(self) -> dict[str, Any]:
        return {"breaker": self.breaker.state, "opened": self.breaker.opened}

    async def close(self) -> None:
        await cancel_and_wait(self._probe)
        await self.client.aclose()
