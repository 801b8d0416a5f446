"""Admission, for every request the gateway serves: infer, generate, generate_stream, the gRPC
stream, metadata and statistics all enter here, and give back what they took in one place.

`enter` runs what costs no more than a hash and a token first (the key, the model list, the rate
limit), then, when asked, takes a slot: an in-flight slot for a request (taken once its body is in,
so a slow upload holds its connection, never the admission limit), a stream slot for a stream
(bounded per worker and per caller). It is idempotent, so a front calls it again as it learns more:
the model once the message names it, the slot once the body is in. Both slots are refused while
the gateway drains. `release` gives back the slot and every byte counted against the caller;
`record.finish` (gateway/pipeline/record.py) calls it for the requests it counts, and `admitted`
for the calls that are not counted (metadata, statistics).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from gateway.errors import Overloaded, Unauthenticated
from gateway.pipeline.call import Call, Slot

if TYPE_CHECKING:
    from gateway.core import Gateway


async def enter(gw: Gateway, call: Call, slot: Slot | None = None) -> None:
    """The key, the model list and the rate limit (once the model is named), then `slot`."""
    authenticate(gw, call)
    if call.named and not call.admitted:
        call.admitted = True
        if call.rate is not None:  # started from the call's headers before its message arrived
            await call.rate
            gw.admit_model(call.principal, call.model)
        else:
            gw.admit_model(call.principal, call.model)
            await gw.check_rate(call.principal, call.client)
    if slot is not None and call.slot is None:
        _take(gw, call, slot)


def authenticate(gw: Gateway, call: Call) -> None:
    if not call.authenticated:
        call.principal = gw.auth.authenticate(call.authorization, call.api_key)
        call.caller = gw.caller_of(call.principal, call.client)
        call.authenticated = True


def _take(gw: Gateway, call: Call, slot: Slot) -> None:
    """503 while draining; else the slot, or the bound it is over."""
    if gw.refusing:
        gw.metrics.shed.labels("draining").inc()
        raise Overloaded("gateway is shutting down; retry on another replica")
    if slot == "stream":
        gw.streams.take(call.caller)  # StreamsExhausted naming the bound
        call.slot = slot
        return
    gw.inflight += 1
    call.slot = slot
    limit = gw.cfg.limits.max_inflight
    if gw.inflight > limit:  # counted first: over the limit only above it
        gw.metrics.shed.labels("inflight").inc()
        raise Overloaded(f"gateway is at its in-flight limit ({limit}); retry later")


def recheck(gw: Gateway, call: Call) -> None:
    """A stream's key still current: Unauthenticated when a reload revoked (or changed) it since the
    stream opened."""
    if not gw.auth.is_current(call.principal):
        assert call.principal is not None
        raise Unauthenticated(
            f"API key {call.principal.name!r} was revoked or changed while this stream was open; "
            "open a new stream with a current key"
        )


async def check_rate(gw: Gateway, call: Call) -> None:
    """The rate limit for one more request of an admitted caller (a stream's next message)."""
    await gw.check_rate(call.principal, call.client)


def check_model(gw: Gateway, call: Call, model: str) -> None:
    """The model a stream's message names, against the key's model list (each message may name
    another)."""
    gw.admit_model(call.principal, model)


def hold(gw: Gateway, call: Call, size: int) -> None:
    """Count `size` more bytes of this request against its caller (given back by `release`)."""
    gw.bodies.reserve(call.caller, size)
    call.held += size


def give_back(gw: Gateway, call: Call, size: int) -> None:
    """`size` of the bytes held given back early (a message written on, a prompt Triton has)."""
    gw.bodies.release(call.caller, size)
    call.held -= size


def release(gw: Gateway, call: Call) -> None:
    """Everything the call took: its bytes, its slot. Safe to call again."""
    gw.bodies.release(call.caller, call.held)
    call.held = 0
    if call.slot == "request":
        gw.inflight -= 1
    elif call.slot == "stream":
        gw.streams.give_back(call.caller)
    call.slot = None


class admitted:  # noqa: N801  (used as `async with admitted(gw, call)`, like a function)
    """A call not counted in the request metrics (metadata, statistics), admitted and holding an
    in-flight slot for the block. A class rather than an async generator: the compiled build
    (mypyc) has no async generators."""

    def __init__(self, gw: Gateway, call: Call) -> None:
        self.gw = gw
        self.call = call

    async def __aenter__(self) -> Call:
        try:
            await enter(self.gw, self.call, "request")
        except BaseException:
            release(self.gw, self.call)
            raise
        return self.call

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        release(self.gw, self.call)
