"""Mirroring one answered request to the candidate version, per protocol: the same request with
the candidate's version (a versioned path over HTTP, `model_version` over gRPC), sent through the
dispatcher like any request (routing, retries), never hedged, never cached, its answer read only
for its classes (gateway/answer_classes.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from gateway.answer_classes import grpc_classes, http_classes
from gateway.dispatch import Attempt
from gateway.shadow import Classes
from gateway.upstream_http import HttpResponse

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.traffic import Plan

HEADER_LENGTH = b"inference-header-content-length"


def versioned_path(model: str, version: str, query: bytes = b"") -> bytes:
    return f"/v2/models/{quote(model, safe='')}/versions/{version}/infer".encode() + query


def version_field(version: str) -> bytes:
    """ModelInferRequest.model_version (field 2) as wire bytes: appended to a message, it overrides
    the field (the last value of a scalar field wins), so the client's bytes are not re-encoded."""
    data = version.encode()
    return b"\x12" + bytes([len(data)]) + data  # versions are short digit strings (< 128 bytes)


def offer_http(
    gw: Gateway, plan: Plan, model: str, resp: HttpResponse, mirror: Attempt[HttpResponse], size: int
) -> None:
    assert gw.shadow is not None and gw.cfg.traffic is not None
    output = gw.cfg.traffic.class_output

    async def send_mirror() -> Classes:
        deadline = gw.clock() + gw.cfg.retries.default_timeout_s
        answer = (await gw.dispatcher.send(model, plan.canary, None, deadline, mirror, hedge=False)).value
        return (
            http_classes(answer.body, answer.header(HEADER_LENGTH), output) if answer.status == 200 else None
        )

    gw.shadow.offer(
        plan, lambda: http_classes(resp.body, resp.header(HEADER_LENGTH), output), send_mirror, size
    )


def offer_grpc(gw: Gateway, plan: Plan, model: str, answer: bytes, mirror: Attempt[bytes], size: int) -> None:
    assert gw.shadow is not None and gw.cfg.traffic is not None
    output = gw.cfg.traffic.class_output

    async def send_mirror() -> Classes:
        deadline = gw.clock() + gw.cfg.retries.default_timeout_s
        raw = (await gw.dispatcher.send(model, plan.canary, None, deadline, mirror, hedge=False)).value
        return grpc_classes(raw, output)

    gw.shadow.offer(plan, lambda: grpc_classes(answer, output), send_mirror, size)
