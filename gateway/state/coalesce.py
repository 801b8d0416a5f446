"""Coalescing (single-flight): identical concurrent requests share one upstream call, not one fate.

The first request for a key leads and calls upstream; later identical ones follow and wait for its
answer. Each follower waits only until its own deadline (then its own 504) and can be cancelled on
its own. What belongs to the leader alone never reaches the followers: when the leader is cancelled
or fails before Triton answered (its deadline, its connection or server: RetryableUpstream), the
waiting followers try again, and one of them leads. Requests pinned to different regions never
coalesce (`Gateway.cached` puts the pin in the coalescing key). Errors Triton
gave for the request itself are shared (an identical request gets the identical error).
The table is bounded in entries: past `max_entries` distinct keys, requests simply run alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.errors import RetryableUpstream, UpstreamTimeout

T = TypeVar("T")


class _LeaderGaveUp(Exception):
    """The leader stopped for a reason of its own (cancelled, or its deadline passed)."""


class Coalescer:
    def __init__(
        self,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.clock = clock
        self._inflight: dict[str, asyncio.Future[Any]] = {}
        self.coalesced = 0  # follow events (a follower that re-follows after a leader gave up counts again)
        self.overflow = 0  # requests that ran alone because the table was full

    def __len__(self) -> int:
        return len(self._inflight)

    async def run(
        self,
        key: str,
        fn: Callable[[], Awaitable[T]],
        deadline: float | None = None,
        on_follow: Callable[[], None] | None = None,
    ) -> tuple[T, bool]:
        """Return (result, shared): shared is True when another caller's call produced it.

        `deadline` is this caller's own (on `clock`); a follower past it raises UpstreamTimeout.
        """
        while True:
            fut = self._inflight.get(key)
            if fut is None:
                if len(self._inflight) >= self.max_entries:
                    self.overflow += 1
                    return await fn(), False
                return await self._lead(key, fn), False
            self.coalesced += 1
            if on_follow is not None:
                on_follow()
            remaining = None if deadline is None else deadline - self.clock()
            if remaining is not None and remaining <= 0:
                raise UpstreamTimeout("deadline exceeded while waiting for an identical in-flight request")
            try:
                return await asyncio.wait_for(asyncio.shield(fut), remaining), True
            except _LeaderGaveUp:
                continue  # the leader's own fate: look again, lead if nobody else does
            except asyncio.TimeoutError:
                if fut.done():  # finished in the same instant: take the leader's answer
                    exc = fut.exception()
                    if isinstance(exc, _LeaderGaveUp):
                        raise UpstreamTimeout(
                            "deadline exceeded while waiting for an identical in-flight request"
                        ) from None
                    return fut.result(), True
                raise UpstreamTimeout(
                    "deadline exceeded while waiting for an identical in-flight request"
                ) from None

    async def _lead(self, key: str, fn: Callable[[], Awaitable[T]]) -> T:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            result = await fn()
        except (asyncio.CancelledError, RetryableUpstream):
            # Cancelled by its own client, out of its own time, or failed before Triton answered
            # (a connection, a server, an attempt of its own): followers must inherit none of these,
            # they try again on their own routes and deadlines.
            fut.set_exception(_LeaderGaveUp())
            fut.exception()  # mark retrieved: nobody may be waiting
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        else:
            fut.set_result(result)
            return result
        finally:
            # Removed before any follower wakes (their wake-ups are scheduled, not run, by set_*),
            # so a follower that looks again finds the slot free.
            if self._inflight.get(key) is fut:
                del self._inflight[key]
