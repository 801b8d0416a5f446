"""Mirroring one answered request to the candidate version, per protocol: the same request with
the candidate's version (a versioned path over HTTP, `model_version` over gRPC), sent through the
dispatcher like any request (routing, retries), never hedged, never cached, its answer read only
for its classes (gateway/pipeline/answer_classes.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar
from urllib.parse import quote

from gateway.fleet.shadow import Classes
from gateway.pipeline.call import Call, Request

if TYPE_CHECKING:
    from gateway.core import Gateway

A = TypeVar("A")


def versioned_path(model: str, version: str, query: bytes = b"") -> bytes:
    return f"/v2/models/{quote(model, safe='')}/versions/{version}/infer".encode() + query


def version_field(version: str) -> bytes:
    """ModelInferRequest.model_version (field 2) as wire bytes: appended to a message, it overrides
    the field (the last value of a scalar field wins), so the client's bytes are not re-encoded."""
    data = version.encode()
    return b"\x12" + bytes([len(data)]) + data  # versions are short digit strings (< 128 bytes)


def offer(gw: Gateway, call: Call, request: Request[A], answer: A) -> None:
    """Offer the answered request to the shadow sampler: mirrored to the candidate with the
    probability its stable answer's class gets (gateway/fleet/shadow.py)."""
    assert gw.shadow is not None and gw.cfg.traffic is not None and call.plan is not None
    plan, model, output = call.plan, call.model, gw.cfg.traffic.class_output
    mirror = request.attempt(plan.canary, shared=True)  # read for its classes: identity encoding

    async def send_mirror() -> Classes:
        deadline = gw.clock() + gw.cfg.retries.default_timeout_s
        mirrored = (await gw.dispatcher.send(model, plan.canary, None, deadline, mirror, hedge=False)).value
        return request.classes(mirrored, output)

    gw.shadow.offer(plan, lambda: request.classes(answer, output), send_mirror, request.size)
