"""KServe v2 / Triton HTTP front.

`/v2/models/{m}[/versions/{v}]/infer` goes through the inference pipeline (gateway/pipeline/run.py,
its HTTP side in gateway/fronts/http_infer.py), served from the HTTP protocol itself
(gateway/fronts/http_protocol.py) on the gateway's own listener. Generate and generate_stream:
gateway/fronts/http_generate.py. Everything else (health, metadata, config, statistics; admin and metrics for admin keys
only, see ops.py) goes to a FastAPI app. Triton's repository, model-control, shared-memory, trace
and logging endpoints are not routed: 404 in Triton's `{"error": ...}` shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.core import Gateway
from gateway.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    RequestTimeout,
    RequestTooLarge,
    UpstreamRejected,
    http_status_for,
)
from gateway.fronts.http_generate import GenerateFront, parse_generate_path
from gateway.fronts.http_infer import (
    AsgiExchange,
    Exchange,
    HttpWire,
    InferLimits,
    error_answer,
    parse_infer_path,
)
from gateway.fronts.request_id import checked_request_id
from gateway.operations.ops import metrics_response, require_admin, upstreams_response
from gateway.operations.statistics import (
    SERVER_HEADER,
    gather_statistics,
    merge_statistics,
    only_allowed,
    statistics_servers,
)
from gateway.pipeline import run
from gateway.state.auth import Principal
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
        self.max_bytes = cfg.limits.max_request_bytes
        self.max_tensors = cfg.limits.max_tensors
        self.inflate_ratio = cfg.limits.max_inflate_ratio
        self.region_header = cfg.routing.region_header.lower().encode()
        self.timeout_header = cfg.retries.timeout_header.lower().encode()
        self.body_timeout_s = cfg.limits.body_read_timeout_s
        self.generate = GenerateFront(self)

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

    async def infer(
        self,
        exchange: Exchange,
        headers: list[tuple[bytes, bytes]],
        model: str,
        version: str,
        raw_path: bytes,
        query: bytes,
        client: str,
    ) -> None:
        """One infer request through the pipeline (gateway/pipeline/run.py)."""
        gw = self.gw
        wire = HttpWire(gw, self.limits, exchange, raw_path, query)
        await run.infer(gw, wire.call(headers, model, version, client, gw.clock()), wire)

    @staticmethod
    async def _respond(send: Any, resp: HttpResponse, extra: list[tuple[bytes, bytes]]) -> None:
        headers = [(k.lower(), v) for k, v in resp.headers if k.lower() in _RETURN]
        headers.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers + extra})
        await send({"type": "http.response.body", "body": resp.body})

    async def _read_body(self, receive: Any, caller: str, held: list[int]) -> bytes:
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await self._receive_body(receive, caller, held)
        except TimeoutError:
            raise RequestTimeout(
                f"request body not received within {self.body_timeout_s:g} s "
                "(limits.body_read_timeout_s); send the body without pauses",
                headers={"connection": "close"},
            ) from None

    async def _receive_body(self, receive: Any, caller: str, held: list[int]) -> bytes:
        """The whole body, each chunk counted in gw.bodies (into `held`) before it is kept."""
        chunks = []
        size = 0
        budget = self.gw.bodies
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client disconnected before sending the whole request body")
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > self.max_bytes:
                    raise RequestTooLarge(f"request body exceeds the limit of {self.max_bytes} bytes")
                budget.reserve(caller, len(chunk))
                held[0] += len(chunk)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _error(
        self, send: Any, exc: BaseException, extra: list[tuple[bytes, bytes]], request_id: str
    ) -> int:
        status, headers, body = error_answer(exc, request_id)
        headers = [*headers, (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return status


def build_api(gw: Gateway) -> FastAPI:
    """Health, metadata, config and statistics; admin and metrics only for admin keys (see ops.py)."""
    api = FastAPI(title="skewserve gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @api.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        if isinstance(exc, UpstreamRejected) and exc.body is not None:
            return Response(exc.body, status_code=exc.http_status, media_type="application/json")
        return JSONResponse({"error": exc.message}, status_code=http_status_for(exc), headers=exc.headers)

    @api.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @api.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if gw.ready() else 400)

    @contextlib.asynccontextmanager
    async def admitted(request: Request, model: str) -> AsyncIterator[Principal | None]:
        """The same admission as inference (drain, in-flight bound, auth, model list, rate limits),
        holding an in-flight slot while the call runs."""
        gw.inflight += 1
        try:
            client = request.client.host if request.client is not None else ""
            yield await gw.admit(
                model, request.headers.get("authorization"), request.headers.get("x-api-key"), client
            )
        finally:
            gw.inflight -= 1

    def raw_path(request: Request) -> bytes:
        # As the client sent it (still percent-encoded): the decoded path can hold spaces or
        # control characters that make Triton drop the connection, which would count against it.
        return bytes(request.scope.get("raw_path") or request.url.path.encode())

    async def proxy(request: Request, model: str = "", version: str = "") -> Response:
        checked_request_id(request.headers.get("x-request-id"))
        async with admitted(request, model):
            return await _proxy(request, model, version)

    async def _proxy(request: Request, model: str, version: str) -> Response:
        path = raw_path(request)
        deadline = gw.deadline(request.headers.get(gw.cfg.retries.timeout_header))

        async def attempt(server: UpstreamServer, timeout_s: float) -> HttpResponse:
            return await server.http_request(b"GET", path, b"", [], timeout_s)

        pinned = request.headers.get(gw.cfg.routing.region_header)
        outcome = await gw.send_metadata(model, version, pinned, deadline, attempt)
        resp = outcome.value
        media = resp.header(b"content-type")
        return Response(
            resp.body,
            status_code=resp.status,
            media_type=media.decode() if media else None,
            headers={
                "x-skewserve-region": outcome.route.server.region,
                "x-skewserve-server": outcome.route.server.name,
            },
        )

    async def statistics(request: Request, model: str = "", version: str = "") -> Response:
        """Triton's statistics extension, summed across the servers the model is routed to."""
        checked_request_id(request.headers.get("x-request-id"))
        async with admitted(request, model) as principal:
            return await _statistics(request, model, version, principal)

    async def _statistics(
        request: Request, model: str, version: str, principal: Principal | None
    ) -> Response:
        path = raw_path(request)
        deadline = gw.deadline(request.headers.get(gw.cfg.retries.timeout_header))
        servers = statistics_servers(
            gw.servers,
            {name: region.servers for name, region in gw.router.regions.items()},
            model,
            version,
            request.headers.get(gw.cfg.routing.region_header),
            gw.cfg.routing.region_header,
            gw.clock(),
            request.headers.get(SERVER_HEADER),
        )

        async def fetch(server: UpstreamServer) -> dict[str, Any]:
            resp = await server.http_request(b"GET", path, b"", [], max(0.0, deadline - gw.clock()))
            if resp.status != 200:
                raise UpstreamRejected(
                    resp.body.decode(errors="replace"), http_status=resp.status, body=resp.body
                )
            return json.loads(resp.body)  # type: ignore[no-any-return]

        answers, answered = await gather_statistics(servers, fetch)
        merged = only_allowed(merge_statistics(answers), principal)
        return JSONResponse(merged, headers={"x-skewserve-stats-servers": ",".join(s.name for s in answered)})

    @api.get("/v2")
    async def server_metadata(request: Request) -> Response:
        return await proxy(request)

    # Statistics first: `/v2/models/stats` must not match `/v2/models/{model}` as a model named "stats".
    api.add_api_route("/v2/models/stats", statistics, methods=["GET"])
    api.add_api_route("/v2/models/{model}/stats", statistics, methods=["GET"])
    api.add_api_route("/v2/models/{model}/versions/{version}/stats", statistics, methods=["GET"])
    for suffix in ("", "/ready", "/config"):
        api.add_api_route(f"/v2/models/{{model}}{suffix}", proxy, methods=["GET"])
        api.add_api_route(f"/v2/models/{{model}}/versions/{{version}}{suffix}", proxy, methods=["GET"])

    @api.get("/admin/upstreams")
    async def upstreams(request: Request) -> JSONResponse:
        require_admin(gw, request)
        return upstreams_response(gw)

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        require_admin(gw, request)
        return metrics_response(gw)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_routed(path: str) -> Response:
        raise NotFound(
            f"/{path} is not served by the gateway (Triton's repository, shared-memory, trace and logging APIs are not exposed)"
        )

    return api
