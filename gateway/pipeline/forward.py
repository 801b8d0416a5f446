"""Route and dispatch: retries, hedging, deadlines and cold starts (gateway/core.py `Gateway.send`,
gateway/fleet/dispatch.py), for a request whose answer is its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, TypeVar

from gateway.errors import NoReadyServer
from gateway.pipeline.call import Call, Request

if TYPE_CHECKING:
    from gateway.core import Gateway

A = TypeVar("A")
STABLE_WAIT_S: Final = 5.0  # a reload's gap (unload, then load) is a second or two on a busy server


async def send(gw: Gateway, call: Call, request: Request[A], shared: bool = False) -> A:
    """The request's answer from one server. A client the gateway put on a canary (its request named
    no version) is answered by the stable version when no server has the canary ready (a load or a
    reload under way): the canary is the gateway's choice, never a reason to fail the client."""
    try:
        outcome = await gw.send(
            call.model,
            call.version,
            call.pinned,
            call.deadline,
            request.attempt(shared=shared),
            sequence_id=request.sequence_id,
        )
    except NoReadyServer:
        plan = call.plan
        if plan is None:
            raise
        call.version, call.role = plan.stable, "stable"
        await stable_listed(gw, call)
        outcome = await gw.send(
            call.model,
            call.version,
            call.pinned,
            call.deadline,
            request.attempt(plan.stable, shared=shared),
            sequence_id=request.sequence_id,
        )
    call.route = outcome.route
    return outcome.value


async def stable_listed(gw: Gateway, call: Call) -> None:
    """Wait (health rounds, within the deadline and STABLE_WAIT_S) for a server to list the stable
    version of a model in canary: a reload takes every version down for a moment, and answering
    unpinned would hand the client the candidate. NoReadyServer, naming it, when none comes."""
    traffic = gw.traffic
    assert traffic is not None and call.plan is not None
    until = min(call.deadline, gw.clock() + STABLE_WAIT_S)
    while not traffic.stable_listed(call.model, call.version):
        remaining = until - gw.clock()
        if remaining <= 0:
            raise NoReadyServer(
                f"model {call.model!r} version {call.version} (the stable version while version "
                f"{call.plan.canary} is in canary) is ready on no server: it is loading; retry"
            )
        await gw.health.next_round(remaining)


def set_deadline(gw: Gateway, call: Call, request: Request[A] | None) -> None:
    """The tightest of the client's timeout header, the request's `timeout` parameter and the call's
    own deadline; else the model's or the default (gateway/core.py `Gateway.deadline`)."""
    timeout_us = None if request is None else request.timeout_us
    call.deadline = gw.deadline(call.timeout_ms, timeout_us, call.model, call.call_remaining)


def plain_deadline(gw: Gateway, call: Call) -> float:
    """The deadline of a call that is no inference (metadata, statistics): the client's own (its
    timeout header, or what was left of a gRPC call's deadline when the call started), else the
    default."""
    left = call.call_remaining
    if left is not None:
        left = max(0.0, left - (gw.clock() - call.started))
    return gw.deadline(call.timeout_ms, None, "", left)
