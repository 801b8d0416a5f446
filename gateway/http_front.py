"""KServe v2 / Triton HTTP front.

`/v2/models/{m}[/versions/{v}]/infer` is served by a raw ASGI handler: the body (JSON, or Triton's
binary tensor extension with `Inference-Header-Content-Length`) is read as Triton reads it
(`gateway/infer_body.py`: inflated, duplicate keys refused, the remaining deadline added as the
`timeout` parameter), binary tensor bytes are forwarded untouched, and Triton's bytes come back
as sent. Everything else (health, metadata, config, statistics; admin and metrics for admin keys
only, see ops.py) goes to a FastAPI app. Triton's repository, model-control, shared-memory, trace
and logging endpoints are not routed: 404 in Triton's `{"error": ...}` shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import Principal
from gateway.cache import cache_key_async
from gateway.cache_alias import ExactAliases
from gateway.core import Gateway
from gateway.dispatch import Attempt, check_version
from gateway.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    RequestTimeout,
    RequestTooLarge,
    UpstreamRejected,
    http_status_for,
)
from gateway.forward_headers import checked_forward_header
from gateway.http_generate import GenerateFront, parse_generate_path
from gateway.infer_body import (
    OFF_LOOP_BYTES,
    InferBody,
    inflate_async,
    inflate_cap,
    parse_header_length,
    parse_infer_body_async,
)
from gateway.ops import metrics_response, require_admin, upstreams_response
from gateway.request_id import checked_request_id, is_valid_request_id, new_request_id
from gateway.shadow_send import offer_http, versioned_path
from gateway.statistics import (
    SERVER_HEADER,
    gather_statistics,
    merge_statistics,
    only_allowed,
    statistics_servers,
)
from gateway.traffic import Plan, Traffic
from gateway.traffic_tally import Role
from gateway.upstream import UpstreamServer
from gateway.upstream_http import HttpResponse

logger = logging.getLogger(__name__)
_JSON = b"application/json"
_FORWARD = {
    b"content-type",
    b"inference-header-content-length",
    b"accept-encoding",
    b"content-encoding",
    b"x-request-id",
}
_RETURN = {b"content-type", b"inference-header-content-length", b"content-encoding"}


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def parse_infer_path(path: str) -> tuple[str, str] | None:
    """('model', 'version' or '') for /v2/models/{m}[/versions/{v}]/infer, else None."""
    parts = path.split("/")
    # ['', 'v2', 'models', m, 'infer'] or ['', 'v2', 'models', m, 'versions', v, 'infer']
    if len(parts) == 5 and parts[4] == "infer":
        return parts[3], ""
    if len(parts) == 7 and parts[4] == "versions" and parts[6] == "infer":
        return parts[3], parts[5]
    return None


# Triton answers JSON it cannot read with HTTP 500 and this text: the request's fault, not the server's.
_TRITON_PARSE_ERROR = b'{"error":"failed to parse the request JSON buffer'


def as_client_error(resp: HttpResponse) -> HttpResponse:
    """Triton's answer, with a 500 the request itself caused (JSON Triton could not read) made the
    400 it is, so it is never counted against the server nor retried elsewhere."""
    if resp.status == 500 and resp.body.startswith(_TRITON_PARSE_ERROR):
        return HttpResponse(400, resp.headers, resp.body)
    return resp


def _encode_entry(resp: HttpResponse) -> bytes:
    meta = json.dumps(
        {"h": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in resp.headers if k.lower() in _RETURN]}
    ).encode()
    return struct.pack("!I", len(meta)) + meta + resp.body


def _decode_entry(raw: bytes) -> HttpResponse:
    (n,) = struct.unpack("!I", raw[:4])
    meta = json.loads(raw[4 : 4 + n])
    return HttpResponse(200, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in meta["h"]], raw[4 + n :])


def _response_header_json(resp: HttpResponse) -> tuple[dict[str, Any], int | None]:
    hl = resp.header(b"inference-header-content-length")
    n = int(hl) if hl is not None else None
    return json.loads(resp.body if n is None else resp.body[:n]), n


def restamp_id(resp: HttpResponse, request_id: str) -> HttpResponse:
    """Give a shared (cached or coalesced) response the `id` of the request it now answers."""
    header, n = _response_header_json(resp)
    if header.get("id", "") == request_id:
        return resp
    if request_id:
        header["id"] = request_id
    else:
        header.pop("id", None)
    new_header = json.dumps(header, separators=(",", ":")).encode()
    if n is None:
        return HttpResponse(resp.status, resp.headers, new_header)
    headers = [
        (k, str(len(new_header)).encode() if k.lower() == b"inference-header-content-length" else v)
        for k, v in resp.headers
    ]
    return HttpResponse(resp.status, headers, new_header + resp.body[n:])


class HttpFront:
    """The ASGI application: the fast infer path in front of the FastAPI app."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.api = build_api(gateway)
        cfg = gateway.cfg
        self.max_bytes = cfg.limits.max_request_bytes
        self.max_batch = cfg.limits.max_batch_size
        self.region_header = cfg.routing.region_header.lower().encode()
        self.timeout_header = cfg.retries.timeout_header.lower().encode()
        self.sticky_header = cfg.traffic.sticky_header.lower().encode() if cfg.traffic else None
        self.body_timeout_s = cfg.limits.body_read_timeout_s
        self.max_tensors = cfg.limits.max_tensors
        self.inflate_ratio = cfg.limits.max_inflate_ratio
        self.aliases: ExactAliases[HttpResponse] = ExactAliases()
        self.generate = GenerateFront(self)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = parse_infer_path(scope["path"])
            if target is not None:
                await self.infer(scope, receive, send, *target)
                return
            generate = parse_generate_path(scope["path"])
            if generate is not None:
                await self.generate(scope, receive, send, *generate)
                return
        await self.api(scope, receive, send)

    async def infer(self, scope: dict[str, Any], receive: Any, send: Any, model: str, version: str) -> None:
        gw = self.gw
        started = gw.clock()
        content_length = header_length = encoding = None
        authorization = api_key = request_id = pinned = timeout_ms = sticky = None
        plan: Plan | None = None
        role: Role | None = None
        forward: list[tuple[bytes, bytes]] = []
        passed_on = False  # a header routing.header_forward_pattern sends on: the answer may depend on it
        request_ids = 0
        for k, v in scope["headers"]:
            if k in _FORWARD:
                # Encoding and header length describe the body as received; they are re-added
                # below for whatever body is forwarded (inflated, or with a timeout spliced in).
                if k == b"inference-header-content-length":
                    header_length = v
                    continue
                if k == b"content-encoding":
                    encoding = v.decode("latin-1")
                    continue
                if k == b"x-request-id":
                    request_ids += 1
                    request_id = v.decode("latin-1")
                    continue  # forwarded once, checked, below
                forward.append((k, v))
            elif k == b"content-length":
                content_length = v
            elif k == b"authorization":
                authorization = v.decode("latin-1")
            elif k == b"x-api-key":
                api_key = v.decode("latin-1")
            elif k == self.region_header:
                pinned = v.decode("latin-1")
            elif k == self.timeout_header:
                timeout_ms = v.decode("latin-1")
            elif k == self.sticky_header:
                sticky = v.decode("latin-1")[:256]
            elif gw.forwarded(k.decode("latin-1")):
                forward.append((k, v))  # checked with the others below
                passed_on = True
        sent_id = request_id
        if request_id is None or request_ids != 1 or not is_valid_request_id(request_id):
            request_id = new_request_id()  # never echo an id that failed the check
        extra = [(b"x-request-id", request_id.encode())]
        status = 500
        route_region = route_server = ""
        counted = False
        caller = ""
        held = [0]  # bytes of this request counted in gw.bodies, given back when it ends
        try:
            version = check_version(version)  # "01" is 1, as Triton reads it; "x" no route (404)
            if request_ids > 1:
                raise BadRequest(f"send one x-request-id header, got {request_ids}")
            if sent_id is not None:
                checked_request_id(sent_id)  # forwarded to Triton and logged: bounded and printable
            forward = [(k, checked_forward_header(k, v)) for k, v in forward]
            forward.append((b"x-request-id", request_id.encode()))
            if content_length is not None:
                if not content_length.isdigit():
                    raise BadRequest(f"Content-Length must be an integer, got {content_length[:40]!r}")
                if len(content_length) > 19 or int(content_length) > self.max_bytes:
                    raise RequestTooLarge(
                        f"request body of {content_length[:25].decode()} bytes exceeds the limit of "
                        f"{self.max_bytes} (limits.max_request_bytes)"
                    )
            # Everything that costs no more than a hash and a token comes before a byte of the body
            # is read: the key, the model list, the rate limit. A caller refused there holds nothing.
            client = (scope.get("client") or ("",))[0]
            principal = await gw.check_caller(model, authorization, api_key, client)
            caller = gw.caller_of(principal, client)
            if gw.traffic is not None:  # a model in canary: its unversioned requests get a version
                version, plan, role = gw.traffic.choose(model, version, sticky or caller)
            # The body is read before the request takes an in-flight slot: a slow upload holds
            # only its connection, bounded by limits.body_read_timeout_s, never the admission limit.
            # Its bytes stay counted against the caller until the request ends.
            body = await self._read_body(receive, caller, held)
            gw.inflight += 1
            counted = True
            gw.check_slot()
            hl = parse_header_length(header_length)
            if encoding is not None and encoding.strip().lower() not in ("", "identity"):
                # The inflated bytes are held too, and the compressed ones are dropped once inflated:
                # count the larger of the two (the cap is never below the compressed size).
                grow = inflate_cap(len(body), self.max_bytes, self.inflate_ratio) - len(body)
                gw.bodies.reserve(caller, max(grow, 0))
                held[0] += max(grow, 0)
            alias = resolved = None
            if gw.cache_enabled(model) and not passed_on:
                if pinned is not None:
                    gw.router.check_pin(pinned)  # a bad pin is a 400 whether or not the answer is cached
                # Once per request: the alias and the key must name the same version.
                resolved = version or gw.router.latest_version(model)
            if resolved is not None and encoding is None and hl != 0 and len(body) < OFF_LOOP_BYTES:
                alias = self._alias_digest(scope, model, resolved, hl, body, gw.cache_tenant(principal))
                hit = await self._alias_hit(model, alias)
                if hit is not None:
                    extra.append((b"x-skewserve-cache", b"hit"))
                    status = hit.status
                    await self._respond(send, hit, extra)
                    return
            if hl == 0:
                # Triton's raw binary request: no JSON header, the whole body is the model's one
                # input. Nothing to read or key: forwarded (inflated) as is, never cached.
                request = None
                if encoding is not None:
                    body = await inflate_async(body, encoding, self.max_bytes, self.inflate_ratio)
                forward.append((b"inference-header-content-length", b"0"))
            else:
                request = await self._parse(model, body, hl, encoding)
            if request is None:  # raw binary, or large plain JSON nobody needs read: forwarded untouched
                timeout_us = None
            else:
                body = request.body
                timeout_us = request.timeout_us
                if self.max_batch:
                    self._check_batch(request)
            deadline = gw.deadline(timeout_ms, timeout_us, model)
            query = b"?" + scope["query_string"] if scope.get("query_string") else b""
            path = scope["raw_path"] + query if plan is None else versioned_path(model, version, query)

            def attempt_at(path: bytes) -> Attempt[HttpResponse]:
                async def attempt(server: UpstreamServer, timeout_s: float) -> HttpResponse:
                    if request is None:
                        return as_client_error(
                            await server.http_request(b"POST", path, body, forward, timeout_s)
                        )
                    # Triton stops work the gateway has given up on: pass this attempt's bound on.
                    data, n = request.with_timeout(timeout_s)
                    headers = (
                        forward if n is None else [*forward, (b"inference-header-content-length", b"%d" % n)]
                    )
                    return as_client_error(await server.http_request(b"POST", path, data, headers, timeout_s))

                return attempt

            attempt = attempt_at(path)

            cache_state = None
            # A sequence's answers depend on its server-side state: never cached, never moved.
            sequence_id = request.sequence_id if request is not None and request.sticky else None
            if gw.cache_enabled(model) and sequence_id is None and request is not None and not passed_on:
                # One stored entry must serve every client: ask Triton for the identity encoding
                # (HTTP lets a server ignore Accept-Encoding), so entries are never gzip bytes.
                forward = [(k, v) for k, v in forward if k != b"accept-encoding"]
                resp, route, cache_state = await self._cached(
                    model,
                    version,
                    resolved or "",
                    pinned,
                    deadline,
                    request,
                    attempt,
                    alias,
                    gw.cache_tenant(principal),
                )
            else:
                outcome = await gw.send(model, version, pinned, deadline, attempt, sequence_id=sequence_id)
                resp, route = outcome.value, outcome.route
            if route is not None:
                route_region, route_server = route.region, route.server.name
                extra += [
                    (b"x-skewserve-region", route_region.encode()),
                    (b"x-skewserve-server", route_server.encode()),
                ]
            if cache_state is not None:
                extra.append((b"x-skewserve-cache", b"hit" if cache_state == "hit" else b"miss"))
            status = resp.status
            await self._respond(send, resp, extra)
            if role == "stable" and plan is not None and plan.shadow > 0 and sequence_id is None:
                mirror = attempt_at(versioned_path(model, plan.canary, query))
                offer_http(gw, plan, model, resp, mirror, len(body))
        except GatewayError as exc:
            status = await self._error(send, exc, extra, request_id)
        except Exception as exc:  # unknown: 500 without internals, logged with the request id
            logger.exception("unhandled error in infer, request_id=%s", request_id)
            status = await self._error(send, exc, extra, request_id)
        finally:
            gw.bodies.release(caller, held[0])
            if counted:
                gw.inflight -= 1
            if plan is not None and role is not None:
                Traffic.record(plan, role, gw.clock() - started, status < 500)
            gw.metrics.request(model, route_region, route_server, "http", str(status), gw.clock() - started)

    @staticmethod
    async def _respond(send: Any, resp: HttpResponse, extra: list[tuple[bytes, bytes]]) -> None:
        headers = [(k.lower(), v) for k, v in resp.headers if k.lower() in _RETURN]
        headers.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers + extra})
        await send({"type": "http.response.body", "body": resp.body})

    def _alias_digest(
        self, scope: dict[str, Any], model: str, resolved: str, hl: int | None, body: bytes, tenant: str
    ) -> bytes:
        """Names these exact bytes as accepted here: model, resolved version, path, header length and
        the limits the request was checked against (a reload may change them) all take part."""
        context = b"\0".join(
            (
                model.encode(),
                resolved.encode(),
                scope["raw_path"],
                scope.get("query_string") or b"",
                b"%d/%d/%d" % (-1 if hl is None else hl, self.max_batch, self.max_tensors),
                tenant.encode(),
            )
        )
        return self.aliases.digest(context, body)

    async def _alias_hit(self, model: str, alias: bytes) -> HttpResponse | None:
        key = self.aliases.key(alias)
        if key is None:
            return None
        stored = await self.gw.cache_lookup(key, model)
        if stored is None:
            return None  # expired or evicted: the keyed path counts the miss and fetches
        return self.aliases.answer(alias, stored, lambda raw: restamp_id(_decode_entry(raw), ""))

    async def _parse(self, model: str, body: bytes, hl: int | None, encoding: str | None) -> InferBody | None:
        """Read the request as Triton will, when anything needs it; None for large plain JSON
        that neither the cache, the batch limit, nor a `timeout`/`sequence_id` parameter needs."""
        if (
            encoding is None
            and hl is None
            and len(body) >= OFF_LOOP_BYTES
            and not self.max_batch
            and not self.gw.cache_enabled(model)
            and b'"timeout"' not in body
            and b'"sequence_id"' not in body
            and b"\\u" not in body  # an escaped key ("\u0074imeout") may spell either
        ):
            return None
        return await parse_infer_body_async(
            body, hl, encoding, self.max_bytes, self.max_tensors, self.inflate_ratio
        )

    async def _cached(
        self,
        model: str,
        version: str,
        resolved: str,
        pinned: str | None,
        deadline: float,
        request: InferBody,
        attempt: Any,
        alias: bytes | None = None,
        tenant: str = "",
    ) -> tuple[HttpResponse, Any, str]:
        gw = self.gw
        if len(request.body) < OFF_LOOP_BYTES:
            canonical, tensors = request.key_material()
        else:
            canonical, tensors = await asyncio.to_thread(request.key_material)
        # "/2": keys over exact `data` text, never equal to the v1 keys over re-serialised values;
        # "/3": walked headers keyed on their exact text, never equal to a canonical key.
        version_tag = "3" if request.keyed_on_text else "2"
        protocol = ("http-binary/" if request.header_length is not None else "http-json/") + version_tag
        key = await cache_key_async(protocol, model, resolved, canonical, tensors, tenant)
        if alias is not None and not request.request_id:
            self.aliases.remember(alias, key)
        route_box: list[Any] = []

        async def fetch() -> tuple[HttpResponse, bytes | None]:
            outcome = await gw.send(model, version, pinned, deadline, attempt)
            route_box.append(outcome.route)
            resp = outcome.value
            if resp.status != 200 or not resolved:
                return resp, None
            try:
                answered = str(_response_header_json(resp)[0].get("model_version", ""))
            except ValueError:
                return resp, None
            # Triton moved to a newer version than the health view knew: do not file it under the old one.
            return resp, (_encode_entry(resp) if answered == resolved else None)

        resp, state = await gw.cached(key, model, fetch, _decode_entry, deadline, pinned)
        if state != "miss" and resp.status == 200:
            resp = restamp_id(resp, request.request_id)
        return resp, (route_box[0] if route_box else None), state

    def _check_batch(self, request: InferBody) -> None:
        for name, batch in request.batch_sizes():
            if batch > self.max_batch:
                raise BadRequest(
                    f"input {name!r} has batch size {batch}, above the gateway limit of {self.max_batch}"
                )

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
        status = http_status_for(exc)
        if isinstance(exc, UpstreamRejected) and exc.body is not None:
            body = exc.body
        elif isinstance(exc, GatewayError):
            body = error_body(exc.message)
            if status >= 500:
                logger.warning("request %s failed: %s", request_id, exc.message)
        else:
            body = error_body("internal gateway error; see the gateway log for request id " + request_id)
        headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode()), *extra]
        if isinstance(exc, GatewayError):
            headers += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
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
