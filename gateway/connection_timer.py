"""One timer for a connection's successive waits (a request's headers, an idle keep-alive, a gRPC
message's body; upstream, each request's answer).

Starting and cancelling an event-loop timer per request for each wait costs about as much as the
rest of the protocol's own work on a request. Here `arm` only moves a deadline, and touches the
loop's timer when the new deadline comes before the pending one; `disarm` clears the wait without
touching it. A timer that fires before the deadline re-arms itself for what is left, so a busy
connection costs one loop timer per bound's length, not several per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

NONE: Final = 0  # no wait armed; other values are the owner's names for its waits


class ConnectionTimer:
    """Calls `on_expiry(wait)` once the wait armed last outlives its deadline (disarmed first: never)."""

    __slots__ = ("loop", "on_expiry", "wait", "deadline", "handle", "handle_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[int], None]) -> None:
        self.loop = loop
        self.on_expiry = on_expiry
        self.wait = NONE
        self.deadline = 0.0
        self.handle: asyncio.TimerHandle | None = None
        self.handle_at = 0.0

    def arm(self, wait: int, timeout_s: float) -> None:
        """Wait `wait` for at most `timeout_s` from now (replacing the wait armed before)."""
        deadline = self.loop.time() + timeout_s
        self.wait = wait
        self.deadline = deadline
        handle = self.handle
        if handle is None or self.handle_at > deadline:  # the pending timer would fire too late
            if handle is not None:
                handle.cancel()
            self.handle = self.loop.call_at(deadline, self._fire)
            self.handle_at = deadline

    def disarm(self, wait: int) -> None:
        """End `wait` (if it is the one armed)."""
        if self.wait == wait:
            self.wait = NONE

    def close(self) -> None:
        """No more waits: the loop's timer is cancelled (the connection is gone)."""
        self.wait = NONE
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _fire(self) -> None:
        self.handle = None
        wait = self.wait
        if wait == NONE:
            return
        if self.loop.time() < self.deadline:
            self.handle = self.loop.call_at(self.deadline, self._fire)
            self.handle_at = self.deadline
            return
        self.wait = NONE
        self.on_expiry(wait)
