"""Request bytes a worker holds at once: bounded in all, and per caller.

Bodies being received, inflated and handled all take memory before anyone has been served. One
bound for everything (limits.max_buffered_body_bytes) keeps the worker inside its memory limit; a
bound per caller (limits.max_buffered_body_bytes_per_caller: an API key, or a client address when
auth is off) keeps one caller from taking all of it, so a key that uploads slowly or in bulk is
refused before everyone else is.
"""

from __future__ import annotations

from gateway.errors import BodiesExhausted


class BodyBudget:
    """Reservations of request bytes; each `reserve` is paired with a `release` of the same count."""

    __slots__ = ("limit", "per_caller", "held", "_by_caller")

    def __init__(self, limit: int, per_caller: int) -> None:
        self.limit = limit
        self.per_caller = per_caller
        self.held = 0
        self._by_caller: dict[str, int] = {}

    def reserve(self, caller: str, n: int) -> None:
        """Count `n` more bytes for `caller`, or raise BodiesExhausted naming the bound (nothing counted)."""
        mine = self._by_caller.get(caller, 0) + n
        # With the two bounds equal the worker's bound is the caller's: named as the worker's.
        if mine > self.per_caller and self.per_caller < self.limit:
            raise BodiesExhausted(
                f"this caller is sending more than {self.per_caller} bytes of requests at once "
                "(limits.max_buffered_body_bytes_per_caller); wait for earlier requests to finish"
            )
        if self.held + n > self.limit:
            raise BodiesExhausted(
                f"the gateway holds more than {self.limit} bytes of requests at once "
                "(limits.max_buffered_body_bytes); retry later"
            )
        self.held += n
        self._by_caller[caller] = mine

    def release(self, caller: str, n: int) -> None:
        if n == 0:
            return
        self.held -= n
        left = self._by_caller.get(caller, 0) - n
        if left > 0:
            self._by_caller[caller] = left
        else:
            self._by_caller.pop(caller, None)  # an idle caller holds no entry: the map stays small

    def callers(self) -> int:
        return len(self._by_caller)
