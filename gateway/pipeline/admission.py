"""Admission: the key, the model list, the rate limit, the in-flight bound.

Everything that costs no more than a hash and a token runs before a byte of the body is read (a
caller refused here holds nothing); the in-flight slot is taken only once the body is in, so a slow
upload holds its connection, never the admission limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.pipeline import canary
from gateway.pipeline.call import Call

if TYPE_CHECKING:
    from gateway.core import Gateway


def authenticate(gw: Gateway, call: Call) -> None:
    if not call.authenticated:
        call.principal = gw.auth.authenticate(call.authorization, call.api_key)
        call.caller = gw.caller_of(call.principal, call.client)
        call.authenticated = True


async def admit(gw: Gateway, call: Call) -> None:
    """The model list and the rate limit, once the model is named (by the path, or the message);
    then, for a model in canary, the version (gateway/pipeline/canary.py)."""
    if call.admitted or not call.named:
        return
    call.admitted = True
    if call.rate is not None:  # started from the call's headers before its message arrived
        await call.rate
        gw.admit_model(call.principal, call.model)
    else:
        gw.admit_model(call.principal, call.model)
        await gw.check_rate(call.principal, call.client)
    canary.choose(gw, call)


def take_slot(gw: Gateway, call: Call) -> None:
    gw.inflight += 1
    call.counted = True
    gw.check_slot()


def hold(gw: Gateway, call: Call, size: int) -> None:
    """Count `size` more bytes of this request against its caller (given back by `record`)."""
    gw.bodies.reserve(call.caller, size)
    call.held += size
