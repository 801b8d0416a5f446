"""A model in canary: its unversioned requests get a version (sticky per client), and each answer
is tallied under the version's role for the controller's gate (gateway/fleet/traffic.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.fleet.traffic import Traffic
from gateway.pipeline.call import Call

if TYPE_CHECKING:
    from gateway.core import Gateway


def choose(gw: Gateway, call: Call) -> None:
    if gw.traffic is not None:
        call.version, call.plan, call.role = gw.traffic.choose(
            call.model, call.version, call.sticky or call.caller
        )


def tally(gw: Gateway, call: Call) -> None:
    if call.plan is not None and call.role is not None:
        Traffic.record(call.plan, call.role, gw.clock() - call.started, call.ok)
