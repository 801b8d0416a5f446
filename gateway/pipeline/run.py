"""The inference pipeline: one chain of steps for both fronts.

A front turns its wire into a `Call` and a `Wire` (how to read the rest of the request, parse it,
answer, refuse); the steps run in this order, each its own module:

  admission  the key, the model list, the rate limit (before a byte of the body), then the slot
  body       the body (HTTP) or message (gRPC), counted against its caller   (the front's `read`)
  canary     the version for a model in canary; whether it names a cascade    (pipeline/canary.py, cascade.py)
  cache      an exact-bytes alias hit, before anything is parsed              (pipeline/cached.py)
  parse      the request as Triton reads it, the gateway's limits, the deadline (the front's `parse`)
  dispatch   cache and coalescing, or route, retries, hedging (pipeline/cached.py, forward.py);
             a cascade's stages, each routed so, until a rule keeps an answer (pipeline/cascade.py)
  respond    the answer on the wire                                           (the front's `respond`)
  shadow     a mirror to the candidate, after the answer is sent             (pipeline/shadow_send.py)
  record     bytes and slot given back, metrics, the canary's tally           (pipeline/record.py)

With `step_timing` each step's time is summed (gateway/operations/step_costs.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar

from gateway.pipeline import admission, cached, canary, cascade, forward, record, shadow_send
from gateway.pipeline.cache_alias import ExactAliases
from gateway.pipeline.call import Call, Request

if TYPE_CHECKING:
    from gateway.core import Gateway

logger: Final = logging.getLogger(__name__)
A = TypeVar("A")


class Wire(Protocol, Generic[A]):
    """What a front does for the pipeline, in its own protocol."""

    aliases: ExactAliases[A]  # the front's exact-bytes aliases (answers are per protocol)
    cancelled: str  # the metrics label of a request cancelled before its answer

    def check_head(self, call: Call) -> None:
        """What the request's head says, checked before anything else (ids, headers, lengths)."""

    async def read(self, call: Call) -> None:
        """The rest of the request in; `call.model` is known after it."""

    def alias(self, call: Call, resolved: str, tenant: str) -> bytes | None:
        """The digest naming these exact bytes as accepted, or None when they cannot have one."""

    def shared(self, stored: bytes) -> A:
        """An answer made from stored bytes for an alias hit (the request has no id)."""

    async def parse(self, call: Call) -> Request[A]: ...

    async def respond(self, call: Call, answer: A) -> None:
        """Send `answer`; sets call.status and call.ok."""

    async def refuse(self, call: Call, exc: BaseException) -> None:
        """Answer with the error; sets call.status and call.ok."""


async def infer(gw: Gateway, call: Call, wire: Wire[A]) -> None:
    costs = gw.step_costs
    t = costs.now()
    try:
        wire.check_head(call)
        await admission.enter(gw, call)  # the key; the model list and rate when the path named it
        t = costs.lap("admission", t)
        await wire.read(call)
        t = costs.lap("body", t)
        await admission.enter(gw, call, "request")  # when the message named it; the slot
        canary.choose(gw, call)
        cascade.choose(gw, call)
        t = costs.lap("admission", t)
        resolved = alias = None
        if gw.cache_enabled(call.model) and not call.passed_on:
            resolved = cached.resolve(gw, call)
            alias = wire.alias(call, resolved, gw.cache_tenant(call.principal))
            if alias is not None:
                hit = await cached.alias_hit(gw, call, wire.aliases, alias, wire.shared)
                t = costs.lap("cache", t)
                if hit is not None:
                    await wire.respond(call, hit)
                    call.answered = True
                    t = costs.lap("respond", t)
                    return
        request = await wire.parse(call)
        request.check()
        forward.set_deadline(gw, call, request)
        t = costs.lap("parse", t)
        if resolved is not None and request.cacheable():
            answer = await cached.answer(gw, call, request, resolved, wire.aliases, alias)
        elif call.cascade is not None:
            answer = await cascade.send(gw, call, request)
        else:
            answer = await forward.send(gw, call, request)
        t = costs.lap("dispatch", t)
        await wire.respond(call, answer)
        call.answered = True
        t = costs.lap("respond", t)
        if (
            call.role == "stable"
            and call.plan is not None
            and call.plan.shadow > 0
            and request.sequence_id is None
        ):
            shadow_send.offer(gw, call, request, answer)
            t = costs.lap("shadow", t)
    except asyncio.CancelledError:
        if not call.answered:  # the client went away (or the server is stopping): not the model's fault
            call.status, call.ok = wire.cancelled, True
        raise
    except Exception as exc:
        if call.answered:  # the client has its answer; what failed after it is the gateway's to log
            logger.error("after answering request %s", call.request_id, exc_info=exc)
        else:
            await wire.refuse(call, exc)
        t = costs.lap("refuse", t)
    finally:
        record.finish(gw, call)
        costs.lap("record", t)
