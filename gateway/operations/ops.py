"""The ops listener: `/metrics` and `/admin/upstreams` off the public port.

The fleet view names every server, its address and its errors, and `/metrics` grows with traffic:
neither belongs on the port clients reach. The ops listener (`listen.ops_host`:`listen.ops_port`,
loopback by default) serves them without credentials, like Envoy's admin port: reach is the access
control. On the public port they answer only an API key with `admin: true`, and 404 to anyone else
in Triton's `{"error": ...}` shape, as any path the gateway does not serve.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.core import Gateway
from gateway.errors import GatewayError, NotFound, PermissionDenied, http_status_for

OPS_PATHS = ("/admin/upstreams", "/metrics")
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def upstreams_response(gw: Gateway) -> JSONResponse:
    return JSONResponse(gw.describe())


def metrics_response(gw: Gateway) -> Response:
    return Response(gw.metrics.render(), media_type=_PROMETHEUS)


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
    """Errors in Triton's `{"error": "..."}` shape, as on every gateway listener."""

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @api.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=http_status_for(exc), headers=exc.headers)


def build_ops_app(gw: Gateway) -> FastAPI:
    """The ops listener's app: metrics, the fleet view, and the gateway's own liveness/readiness."""
    api = FastAPI(title="skewserve gateway ops", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(api)

    @api.get("/metrics")
    async def metrics() -> Response:
        return metrics_response(gw)

    @api.get("/admin/upstreams")
    async def upstreams() -> JSONResponse:
        return upstreams_response(gw)

    @api.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @api.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if gw.ready() else 400)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_served(path: str) -> Response:
        raise NotFound(
            f"/{path} is not served on the ops listener: it serves {', '.join(OPS_PATHS)} and "
            "/v2/health/*; inference goes to the public port"
        )

    return api
