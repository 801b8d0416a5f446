"""The end of every request, answered or refused: its bytes and slot given back, its answer counted
(metrics; the canary's tally)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.pipeline import admission, canary
from gateway.pipeline.call import Call

if TYPE_CHECKING:
    from gateway.core import Gateway


def finish(gw: Gateway, call: Call) -> None:
    admission.release(gw, call)
    canary.tally(gw, call)
    route = call.route
    gw.metrics.request(
        call.model,
        route.region if route is not None else "",
        route.server.name if route is not None else "",
        call.protocol,
        call.status,
        gw.clock() - call.started,
    )
