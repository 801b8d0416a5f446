"""The ops endpoints, once for both HTTP listeners: `/metrics`, `/admin/upstreams`, the gateway's own
health, and errors in Triton's shape; and the ops listener's app, which serves them off the public port.

The fleet view names every server, its address and its errors, and `/metrics` grows with traffic:
neither belongs on the port clients reach. The ops listener (`listen.ops_host`:`listen.ops_port`,
loopback by default) serves them without credentials, like Envoy's admin port: reach is the access
control. On the public port they answer only an API key with `admin: true`, and 404 to anyone else
in Triton's `{"error": ...}` shape, as any path the gateway does not serve.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.core import Gateway
from gateway.errors import GatewayError, NotFound, PermissionDenied, UpstreamRejected, http_status_for

OPS_PATHS = ("/admin/upstreams", "/metrics")
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def require_admin(gw: Gateway, request: Request) -> None:
    """On the public port: an admin-scoped API key, else 404 (401/403 for a bad or non-admin key)."""
    authorization = request.headers.get("authorization")
    api_key = request.headers.get("x-api-key")
    admins = gw.cfg.auth.admin_names()
    if admins and (authorization or api_key):
        principal = gw.auth.authenticate(authorization, api_key)
        if principal is not None and principal.name in admins:
            return
        if principal is not None:
            raise PermissionDenied(f"API key {principal.name!r} is not an admin key (auth.keys[].admin)")
    raise NotFound(
        f"{request.url.path} is not served on the public port: read it on the ops listener "
        "(listen.ops_port) or send an admin API key (auth.keys[].admin)"
    )


def add_error_handlers(api: FastAPI) -> None:
    """Errors in Triton's `{"error": "..."}` shape, as on every gateway listener; Triton's own
    rejection passed on as it came."""

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @api.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        if isinstance(exc, UpstreamRejected) and exc.body is not None:
            return Response(exc.body, status_code=exc.http_status, media_type="application/json")
        return JSONResponse({"error": exc.message}, status_code=http_status_for(exc), headers=exc.headers)


def add_health_routes(api: FastAPI, gw: Gateway) -> None:
    """The gateway's own liveness and readiness (`Gateway.ready`), unkeyed as Triton's are."""

    @api.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @api.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if gw.ready() else 400)


def add_ops_routes(api: FastAPI, gw: Gateway, guard: Callable[[Gateway, Request], None] | None) -> None:
    """`/metrics` and the fleet view; `guard` (the public port's `require_admin`) runs first."""

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        if guard is not None:
            guard(gw, request)
        return Response(gw.metrics.render(), media_type=_PROMETHEUS)

    @api.get("/admin/upstreams")
    async def upstreams(request: Request) -> JSONResponse:
        if guard is not None:
            guard(gw, request)
        return JSONResponse(gw.describe())


def build_ops_app(gw: Gateway) -> FastAPI:
    """The ops listener's app: metrics, the fleet view, and the gateway's own liveness/readiness."""
    api = FastAPI(title="skewserve gateway ops", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(api)
    add_ops_routes(api, gw, guard=None)
    add_health_routes(api, gw)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_served(path: str) -> Response:
        raise NotFound(
            f"/{path} is not served on the ops listener: it serves {', '.join(OPS_PATHS)} and "
            "/v2/health/*; inference goes to the public port"
        )

    return api
