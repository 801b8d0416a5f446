"""Open streams a worker carries: bounded in all, and per caller.

A stream (gRPC ModelStreamInfer, HTTP generate_stream) holds an upstream stream, a task and
buffers for as long as its client keeps it open, so open streams are a resource of their own:
limits.max_streams bounds them per worker, limits.max_streams_per_caller per API key (or client
address with auth off), so one caller opening streams it never uses is refused before anyone else.
"""

from __future__ import annotations

from gateway.errors import BodiesExhausted


class StreamsExhausted(BodiesExhausted):
    """503 over HTTP, RESOURCE_EXHAUSTED over gRPC: the streams are the resource."""


class StreamSlots:
    __slots__ = ("limit", "per_caller", "open", "_by_caller")

    def __init__(self, limit: int, per_caller: int) -> None:
        self.limit = limit
        self.per_caller = per_caller
        self.open = 0
        self._by_caller: dict[str, int] = {}

    def take(self, caller: str) -> None:
        """One more stream of `caller` open (given back by `give_back`); StreamsExhausted naming
        the bound otherwise."""
        mine = self._by_caller.get(caller, 0)
        if mine >= self.per_caller:
            raise StreamsExhausted(
                f"this caller has {mine} streams open (limits.max_streams_per_caller); "
                "close one before opening another"
            )
        if self.open >= self.limit:
            raise StreamsExhausted(
                f"the gateway carries {self.open} streams (limits.max_streams); retry later"
            )
        self.open += 1
        self._by_caller[caller] = mine + 1

    def give_back(self, caller: str) -> None:
        self.open -= 1
        left = self._by_caller[caller] - 1
        if left:
            self._by_caller[caller] = left
        else:
            del self._by_caller[caller]
