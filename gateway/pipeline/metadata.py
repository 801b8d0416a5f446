"""Health, metadata and config of a model or of the server, for both fronts: admitted as any request,
sent to a server that has the model ready if there is one, else to any server, so "unknown model"
and "not ready" come back in Triton's own words (gateway/core.py `Gateway.send_metadata`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from gateway.fleet.dispatch import Attempt, Outcome
from gateway.pipeline import admission, forward
from gateway.pipeline.call import Call

if TYPE_CHECKING:
    from gateway.core import Gateway

T = TypeVar("T")


async def ask(gw: Gateway, call: Call, attempt: Attempt[T]) -> Outcome[T]:
    async with admission.admitted(gw, call):
        deadline = forward.plain_deadline(gw, call)
        return await gw.send_metadata(call.model, call.version, call.pinned, deadline, attempt)
