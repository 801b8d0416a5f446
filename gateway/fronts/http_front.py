"""KServe v2 / Triton HTTP front.

`/v2/models/{m}[/versions/{v}]/infer` goes through the inference pipeline (gateway/pipeline/run.py,
its HTTP side in gateway/fronts/http_infer.py), served from the HTTP protocol itself
(gateway/fronts/http_protocol.py) on the gateway's own listener. Generate and generate_stream:
gateway/fronts/http_generate.py. Everything else (health, metadata, config, statistics; admin and metrics for admin keys
only, see http_ops.py) goes to a FastAPI app. Triton's repository, model-control, shared-memory, trace
and logging endpoints are not routed: 404 in Triton's `{"error": ...}` shape.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.core import Gateway
from gateway.errors import (
    NotFound,
    UpstreamRejected,
)
from gateway.fronts.http_generate import GenerateFront, parse_generate_path
from gateway.fronts.http_infer import (
    AsgiExchange,
    InferLimits,
    parse_infer_path,
    serve_infer,
)
from gateway.fronts.http_ops import add_error_handlers, add_health_routes, add_ops_routes, require_admin
from gateway.fronts.request_id import checked_request_id
from gateway.pipeline import metadata, statistics
from gateway.pipeline.call import Call
from gateway.pipeline.statistics import SERVER_HEADER
from gateway.upstream.http_client import HttpResponse
from gateway.upstream.server import UpstreamServer

logger = logging.getLogger(__name__)
_RETURN = {b"content-type", b"inference-header-content-length", b"content-encoding"}


class HttpFront:
    """The ASGI application: infer through the pipeline (served from the protocol itself by
    gateway/fronts/http_protocol.py, or from ASGI under another server), generate, and the FastAPI
    app for everything else."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.api = build_api(gateway)
        cfg = gateway.cfg
        self.limits = InferLimits(cfg)
        self.generate = GenerateFront(gateway, self.limits)
        # One infer request (the protocol's entry, and ASGI's below): the compiled coroutine itself,
        # with no interpreted frame around it.
        self.infer: Callable[..., Awaitable[None]] = functools.partial(serve_infer, gateway, self.limits)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = parse_infer_path(scope["path"])
            if target is not None:
                client = (scope.get("client") or ("",))[0]
                await self.infer(
                    AsgiExchange(receive, send),
                    scope["headers"],
                    *target,
                    scope["raw_path"],
                    scope["query_string"],
                    client,
                )
                return
            generate = parse_generate_path(scope["path"])
            if generate is not None:
                await self.generate(scope, receive, send, *generate)
                return
        await self.api(scope, receive, send)


def build_api(gw: Gateway) -> FastAPI:
    """Health, metadata, config and statistics; admin and metrics only for admin keys (http_ops.py)."""
    api = FastAPI(title="skewserve gateway", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(api)
    add_health_routes(api, gw)

    async def proxy(request: Request, model: str = "", version: str = "") -> Response:
        path = _raw_path(request)

        async def attempt(server: UpstreamServer, timeout_s: float) -> HttpResponse:
            return await server.http_request(b"GET", path, b"", [], timeout_s)

        outcome = await metadata.ask(gw, _call(gw, request, model, version), attempt)
        resp, server = outcome.value, outcome.route.server
        media = resp.header(b"content-type")
        return Response(
            resp.body,
            status_code=resp.status,
            media_type=media.decode() if media else None,
            headers={"x-skewserve-region": server.region, "x-skewserve-server": server.name},
        )

    async def stats(request: Request, model: str = "", version: str = "") -> Response:
        """Triton's statistics extension, summed across the servers the model is routed to."""
        path = _raw_path(request)

        async def fetch(server: UpstreamServer, timeout_s: float) -> dict[str, Any]:
            resp = await server.http_request(b"GET", path, b"", [], timeout_s)
            if resp.status != 200:
                raise UpstreamRejected(
                    resp.body.decode(errors="replace"), http_status=resp.status, body=resp.body
                )
            return json.loads(resp.body)  # type: ignore[no-any-return]

        call = _call(gw, request, model, version)
        merged, answered = await statistics.answer(gw, call, request.headers.get(SERVER_HEADER), fetch)
        return JSONResponse(merged, headers={"x-skewserve-stats-servers": ",".join(s.name for s in answered)})

    api.add_api_route("/v2", proxy, methods=["GET"])
    # Statistics first: `/v2/models/stats` must not match `/v2/models/{model}` as a model named "stats".
    for prefix in ("/v2/models", "/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        api.add_api_route(f"{prefix}/stats", stats, methods=["GET"])
    for suffix in ("", "/ready", "/config"):
        api.add_api_route(f"/v2/models/{{model}}{suffix}", proxy, methods=["GET"])
        api.add_api_route(f"/v2/models/{{model}}/versions/{{version}}{suffix}", proxy, methods=["GET"])
    add_ops_routes(api, gw, guard=require_admin)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_routed(path: str) -> Response:
        raise NotFound(
            f"/{path} is not served by the gateway (Triton's repository, shared-memory, trace and logging APIs are not exposed)"
        )

    return api


def _call(gw: Gateway, request: Request, model: str, version: str) -> Call:
    """A metadata or statistics request as admission and the steps read it."""
    headers = request.headers
    request_id = checked_request_id(headers.get("x-request-id"))
    return Call(
        "http",
        gw.clock(),
        model,
        version,
        named=True,
        request_id=request_id,
        client=request.client.host if request.client is not None else "",
        authorization=headers.get("authorization"),
        api_key=headers.get("x-api-key"),
        pinned=headers.get(gw.cfg.routing.region_header),
        timeout_ms=headers.get(gw.cfg.retries.timeout_header),
    )


def _raw_path(request: Request) -> bytes:
    # As the client sent it (still percent-encoded): the decoded path can hold spaces or
    # control characters that make Triton drop the connection, which would count against it.
    return bytes(request.scope.get("raw_path") or request.url.path.encode())
