"""The HTTP front of the inference pipeline: `/v2/models/{m}[/versions/{v}]/infer` read from the
wire into a `Call`, and the pipeline's answer written back.

The request is read as Triton reads it (gateway/fronts/infer_body.py: inflated, duplicate keys
refused, the remaining deadline added as the `timeout` parameter); binary tensor bytes and raw
bodies are forwarded untouched, and Triton's bytes come back as sent. The bytes arrive either from
the HTTP protocol itself (gateway/fronts/infer_exchange.py `InferExchange`: no ASGI on this path) or,
under another ASGI server, from ASGI messages (`AsgiExchange`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Callable
from typing import Any, Final, Protocol
from urllib.parse import quote

from gateway.errors import (
    BadRequest,
    GatewayError,
    RequestTimeout,
    RequestTooLarge,
    UpstreamRejected,
    http_status_for,
)
from gateway.fleet.cascade import PARAMETERS, Mark, header_name
from gateway.fleet.dispatch import Attempt, SequenceId, check_version
from gateway.forward_headers import checked_forward_header, checked_forwarded_total
from gateway.fronts.infer_body import (
    OFF_LOOP_BYTES,
    InferBody,
    inflate_async,
    inflate_cap,
    parse_header_length,
    parse_infer_body_async,
)
from gateway.fronts.request_id import checked_request_id, is_valid_request_id, new_request_id
from gateway.pipeline import admission, run
from gateway.pipeline.answer_classes import http_classes, http_output
from gateway.pipeline.cache_alias import ExactAliases
from gateway.pipeline.call import Call
from gateway.pipeline.shadow_send import versioned_path
from gateway.state.cache import cache_key_async
from gateway.upstream.http_client import HttpResponse
from gateway.upstream.server import UpstreamServer

logger: Final = logging.getLogger(__name__)
JSON: Final = b"application/json"
HEADER_LENGTH: Final = b"inference-header-content-length"
_FORWARD: Final = {b"content-type", b"accept-encoding"}
# A cascade's mark travels in headers too, stored with the answer (gateway/fleet/cascade.py).
_CASCADE_HEADERS: Final = frozenset(header_name(p).encode() for p in PARAMETERS)
_RETURN: Final = {b"content-type", HEADER_LENGTH, b"content-encoding", *_CASCADE_HEADERS}
# Triton answers JSON it cannot read, and tensor data it cannot read as the shape and datatype say
# (more values than the shape holds), with HTTP 500 and these texts: the request's fault, not the server's.
_TRITON_PARSE_ERRORS: Final = (
    b'{"error":"failed to parse the request JSON buffer',
    b'{"error":"Unable to parse \'',
)


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def parse_infer_path(path: str) -> tuple[str, str] | None:
    """('model', 'version' or '') for /v2/models/{m}[/versions/{v}]/infer, else None."""
    parts = path.split("/")
    # ['', 'v2', 'models', m, 'infer'] or ['', 'v2', 'models', m, 'versions', v, 'infer']
    if len(parts) == 5 and parts[4] == "infer" and parts[1] == "v2" and parts[2] == "models":
        return parts[3], ""
    if (
        len(parts) == 7
        and parts[4] == "versions"
        and parts[6] == "infer"
        and parts[1] == "v2"
        and parts[2] == "models"
    ):
        return parts[3], parts[5]
    return None


def as_client_error(resp: HttpResponse) -> HttpResponse:
    """Triton's answer, with a 500 the request itself caused (JSON Triton could not read) made the
    400 it is, so it is never counted against the server nor retried elsewhere."""
    if resp.status == 500 and resp.body.startswith(_TRITON_PARSE_ERRORS):
        return HttpResponse(400, resp.headers, resp.body)
    return resp


def encode_entry(resp: HttpResponse) -> bytes:
    meta = json.dumps(
        {"h": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in resp.headers if k.lower() in _RETURN]}
    ).encode()
    return struct.pack("!I", len(meta)) + meta + resp.body


def decode_entry(raw: bytes) -> HttpResponse:
    (n,) = struct.unpack("!I", raw[:4])
    meta = json.loads(raw[4 : 4 + n])
    return HttpResponse(200, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in meta["h"]], raw[4 + n :])


def _response_header_json(resp: HttpResponse) -> tuple[dict[str, Any], int | None]:
    hl = resp.header(HEADER_LENGTH)
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
        (k, str(len(new_header)).encode() if k.lower() == HEADER_LENGTH else v) for k, v in resp.headers
    ]
    return HttpResponse(resp.status, headers, new_header + resp.body[n:])


def mark_answer(resp: HttpResponse, mark: Mark) -> HttpResponse:
    """A successful answer with a cascade's mark in its `parameters` and in headers (any mark it
    came with, from a gateway behind a stage, replaced)."""
    header, n = _response_header_json(resp)
    params = header.get("parameters")
    theirs = {k: v for k, v in (params if isinstance(params, dict) else {}).items() if k not in PARAMETERS}
    header["parameters"] = {**theirs, **mark.parameters()}
    new_header = json.dumps(header, separators=(",", ":")).encode()
    headers = [
        (k, str(len(new_header)).encode() if k.lower() == HEADER_LENGTH else v)
        for k, v in resp.headers
        if k.lower() not in _CASCADE_HEADERS
    ]
    headers += [(k.encode(), v.encode()) for k, v in mark.headers()]
    return HttpResponse(resp.status, headers, new_header if n is None else new_header + resp.body[n:])


def error_answer(exc: BaseException, request_id: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) answering `exc` in Triton's `{"error": ...}` shape: Triton's own
    bytes when it refused; an unknown error a 500 without internals, logged with the request id."""
    status = http_status_for(exc)
    if isinstance(exc, UpstreamRejected) and exc.body is not None:
        body = exc.body
    elif isinstance(exc, GatewayError):
        body = error_body(exc.message)
        if status >= 500:
            logger.warning("request %s failed: %s", request_id, exc.message)
    else:
        logger.error("unhandled error, request_id=%s", request_id, exc_info=exc)
        body = error_body("internal gateway error; see the gateway log for request id " + request_id)
    headers = [(b"content-type", JSON)]
    if isinstance(exc, GatewayError):
        headers += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
    return status, headers, body


class Exchange(Protocol):
    """One request's bytes in and its answer out, as the transport under the front gives them."""

    def whole_body(self) -> bytes | None:
        """The whole body when it is already in (no wait), else None."""

    async def receive_chunk(self) -> tuple[bytes, bool] | None:
        """(bytes, more to come), or None when the client disconnected."""

    async def write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...


async def receive_body(
    exchange: Exchange, limit: int, timeout_s: float, hold: Callable[[int], None]
) -> bytes:
    """The whole body within `timeout_s` (limits.body_read_timeout_s), each chunk counted against
    its caller (`hold`) before it is kept."""
    if asyncio.current_task() is None:
        # Run from the protocol's callback (gateway/fronts/eager_start.py): the request is whole,
        # so nothing here waits, and asyncio.timeout needs a task.
        return await _receive_chunks(exchange, limit, hold)
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive_chunks(exchange, limit, hold)
    except TimeoutError:
        raise RequestTimeout(
            f"request body not received within {timeout_s:g} s "
            "(limits.body_read_timeout_s); send the body without pauses",
            headers={"connection": "close"},
        ) from None


async def _receive_chunks(exchange: Exchange, limit: int, hold: Callable[[int], None]) -> bytes:
    chunks = []
    size = 0
    while True:
        got = await exchange.receive_chunk()
        if got is None:
            raise BadRequest("the client disconnected before sending the whole request body")
        chunk, more = got
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
            hold(len(chunk))
            chunks.append(chunk)
        if not more:
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class InferLimits:
    """The infer path's settings, read once from the config (a reload builds a new front)."""

    __slots__ = (
        "max_bytes",
        "max_batch",
        "max_tensors",
        "inflate_ratio",
        "body_timeout_s",
        "region_header",
        "timeout_header",
        "sticky_header",
        "aliases",
    )

    def __init__(self, cfg: Any) -> None:
        self.max_bytes: int = cfg.limits.max_request_bytes
        self.max_batch: int = cfg.limits.max_batch_size
        self.max_tensors: int = cfg.limits.max_tensors
        self.inflate_ratio: float = cfg.limits.max_inflate_ratio
        self.body_timeout_s: float = cfg.limits.body_read_timeout_s
        self.region_header = cfg.routing.region_header.lower().encode()
        self.timeout_header = cfg.retries.timeout_header.lower().encode()
        self.sticky_header = cfg.traffic.sticky_header.lower().encode() if cfg.traffic else None
        self.aliases: ExactAliases[HttpResponse] = ExactAliases()


class HttpWire:
    """The pipeline's view of one HTTP infer request (gateway/pipeline/run.py `Wire`)."""

    cancelled = "499"  # the client closed the connection before its answer (nginx's code)

    __slots__ = (
        "gw",
        "limits",
        "aliases",
        "exchange",
        "raw_path",
        "query",
        "forward",
        "content_length",
        "header_length",
        "encoding",
        "sent_id",
        "request_ids",
        "body",
        "hl",
    )

    def __init__(
        self, gw: Any, limits: InferLimits, exchange: Exchange, raw_path: bytes, query: bytes
    ) -> None:
        self.gw = gw
        self.limits = limits
        self.aliases = limits.aliases
        self.exchange = exchange
        self.raw_path = raw_path
        self.query = b"?" + query if query else b""
        self.forward: list[tuple[bytes, bytes]] = []
        self.content_length: bytes | None = None
        self.header_length: bytes | None = None
        self.encoding: str | None = None
        self.sent_id: str | None = None
        self.request_ids = 0
        self.body = b""
        self.hl: int | None = None

    def call(
        self, headers: list[tuple[bytes, bytes]], model: str, version: str, client: str, started: float
    ) -> Call:
        """The call this request's headers describe (checked in `check_head`, inside the pipeline)."""
        call = Call("http", started, model, version, client=client, named=True)
        limits, gw, forward = self.limits, self.gw, self.forward
        for k, v in headers:
            if k == b"content-type" or k == b"accept-encoding":
                forward.append((k, v))
            elif k == b"content-length":
                self.content_length = v
            elif k == b"authorization":
                call.authorization = v.decode("latin-1")
            elif k == b"x-api-key":
                call.api_key = v.decode("latin-1")
            elif k == HEADER_LENGTH:
                # Encoding and header length describe the body as received; they are re-added for
                # whatever body is forwarded (inflated, or with a timeout spliced in).
                self.header_length = v
            elif k == b"content-encoding":
                self.encoding = v.decode("latin-1")
            elif k == b"x-request-id":
                self.request_ids += 1
                self.sent_id = v.decode("latin-1")
            elif k == limits.region_header:
                call.pinned = v.decode("latin-1")
            elif k == limits.timeout_header:
                call.timeout_ms = v.decode("latin-1")
            elif k == limits.sticky_header:
                call.sticky = v.decode("latin-1")[:256]
            elif gw.forwarded(k.decode("latin-1")):
                forward.append((k, v))  # checked with the others in check_head
                call.passed_on = True  # the answer may depend on it
        sent = self.sent_id
        call.request_id = (
            sent
            if sent is not None and self.request_ids == 1 and is_valid_request_id(sent)
            else new_request_id()
        )  # never echo an id that failed the check
        return call

    # -- the pipeline's steps, HTTP's part -------------------------------------------------------
    def check_head(self, call: Call) -> None:
        call.version = check_version(call.version)  # "01" is 1, as Triton reads it; "x" no route (404)
        if self.request_ids > 1:
            raise BadRequest(f"send one x-request-id header, got {self.request_ids}")
        if self.sent_id is not None:
            checked_request_id(self.sent_id)  # forwarded to Triton and logged: bounded and printable
        self.forward = [(k, checked_forward_header(k, v)) for k, v in self.forward]
        checked_forwarded_total(self.forward)
        self.forward.append((b"x-request-id", call.request_id.encode()))
        length = self.content_length
        if length is not None:
            if not length.isdigit():
                raise BadRequest(f"Content-Length must be an integer, got {length[:40]!r}")
            if len(length) > 19 or int(length) > self.limits.max_bytes:
                raise RequestTooLarge(
                    f"request body of {length[:25].decode()} bytes exceeds the limit of "
                    f"{self.limits.max_bytes} (limits.max_request_bytes)"
                )

    async def read(self, call: Call) -> None:
        whole = self.exchange.whole_body()
        if whole is not None:  # arrived with the headers: no timer to arm
            if len(whole) > self.limits.max_bytes:
                raise RequestTooLarge(f"request body exceeds the limit of {self.limits.max_bytes} bytes")
            admission.hold(self.gw, call, len(whole))
            self.body = whole
            return
        gw, limits = self.gw, self.limits
        self.body = await receive_body(
            self.exchange, limits.max_bytes, limits.body_timeout_s, lambda n: admission.hold(gw, call, n)
        )

    def alias(self, call: Call, resolved: str, tenant: str) -> bytes | None:
        """Names these exact bytes as accepted here: model, resolved version, path, header length and
        the limits the request was checked against (a reload may change them) all take part."""
        self.hl = hl = parse_header_length(self.header_length)
        if self.encoding is not None or hl == 0 or len(self.body) >= OFF_LOOP_BYTES:
            return None
        limits = self.limits
        context = b"\0".join(
            (
                call.model.encode(),
                resolved.encode(),
                self.raw_path,
                self.query[1:],
                b"%d/%d/%d" % (-1 if hl is None else hl, limits.max_batch, limits.max_tensors),
                tenant.encode(),
            )
        )
        return self.aliases.name(context, self.body)

    @staticmethod
    def shared(stored: bytes) -> HttpResponse:
        return restamp_id(decode_entry(stored), "")

    async def parse(self, call: Call) -> HttpInferRequest:
        limits, body, encoding = self.limits, self.body, self.encoding
        if call.principal is not None and call.principal.headers:  # the key's own (auth.keys[].headers)
            self.forward += [(k.encode(), v.encode()) for k, v in call.principal.headers]
        hl = self.hl = parse_header_length(self.header_length)
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            # The inflated bytes are held too, and the compressed ones are dropped once inflated:
            # count the larger of the two (the cap is never below the compressed size).
            grow = inflate_cap(len(body), limits.max_bytes, limits.inflate_ratio) - len(body)
            admission.hold(self.gw, call, max(grow, 0))
        if hl == 0:
            # Triton's raw binary request: no JSON header, the whole body is the model's one input.
            # Nothing to read or key: forwarded (inflated) as is, never cached.
            if encoding is not None:
                body = await inflate_async(body, encoding, limits.max_bytes, limits.inflate_ratio)
            self.forward.append((HEADER_LENGTH, b"0"))
            return HttpInferRequest(self, call, None, body)
        parsed = await self._parse_body(call.model, body, hl, encoding)
        return HttpInferRequest(self, call, parsed, body if parsed is None else parsed.body)

    async def _parse_body(
        self, model: str, body: bytes, hl: int | None, encoding: str | None
    ) -> InferBody | None:
        """Read the request as Triton will, when anything needs it; None for large plain JSON
        that neither the cache, the batch limit, nor a `timeout`/`sequence_id` parameter needs."""
        limits = self.limits
        if (
            encoding is None
            and hl is None
            and len(body) >= OFF_LOOP_BYTES
            and not limits.max_batch
            and not self.gw.cache_enabled(model)
            and b'"timeout"' not in body
            and b'"sequence_id"' not in body
            and b"\\u" not in body  # an escaped key ("\u0074imeout") may spell either
        ):
            return None
        return await parse_infer_body_async(
            body, hl, encoding, limits.max_bytes, limits.max_tensors, limits.inflate_ratio
        )

    def _headers(self, call: Call) -> list[tuple[bytes, bytes]]:
        out = [(b"x-request-id", call.request_id.encode())]
        route = call.route
        if route is not None:
            out.append((b"x-skewserve-region", route.region.encode()))
            out.append((b"x-skewserve-server", route.server.name.encode()))
        if call.cache_state is not None:
            out.append((b"x-skewserve-cache", b"hit" if call.cache_state == "hit" else b"miss"))
        return out

    async def respond(self, call: Call, resp: HttpResponse) -> None:
        call.status = str(resp.status)
        call.ok = resp.status < 500
        headers = [(k.lower(), v) for k, v in resp.headers if k.lower() in _RETURN]
        headers += self._headers(call)
        await self.exchange.write(resp.status, headers, resp.body)

    async def refuse(self, call: Call, exc: BaseException) -> None:
        status, headers, body = error_answer(exc, call.request_id)
        call.status = str(status)
        call.ok = status < 500
        await self.exchange.write(status, [*headers, *self._headers(call)], body)


class HttpInferRequest:
    """An HTTP infer request as the pipeline's cache, dispatch and shadow steps use it."""

    __slots__ = ("wire", "call", "parsed", "body", "size", "sequence_id", "timeout_us", "request_id")

    def __init__(self, wire: HttpWire, call: Call, parsed: InferBody | None, body: bytes) -> None:
        self.wire = wire
        self.call = call
        self.parsed = parsed
        self.body = body
        self.size = len(body)
        # A sequence's answers depend on its server-side state: never cached, never moved.
        self.sequence_id: SequenceId = parsed.sequence_id if parsed is not None and parsed.sticky else None
        self.timeout_us = parsed.timeout_us if parsed is not None else None
        self.request_id = parsed.request_id if parsed is not None else ""

    def check(self) -> None:
        max_batch = self.wire.limits.max_batch
        if max_batch and self.parsed is not None:
            for name, batch in self.parsed.batch_sizes():
                if batch > max_batch:
                    raise BadRequest(
                        f"input {name!r} has batch size {batch}, above the gateway limit of {max_batch}"
                    )

    def cacheable(self) -> bool:
        return self.parsed is not None and self.sequence_id is None

    async def cache_key(self, resolved: str, tenant: str) -> str:
        parsed = self.parsed
        assert parsed is not None
        if len(parsed.body) < OFF_LOOP_BYTES:
            canonical, tensors = parsed.key_material()
        else:
            canonical, tensors = await asyncio.to_thread(parsed.key_material)
        # "/3": walked headers keyed on their exact text, never equal to a canonical key; "/4": the
        # canonical JSON by orjson (an entry stored under "/2", by `json`, is not looked for).
        version_tag = "3" if parsed.keyed_on_text else "4"
        protocol = ("http-binary/" if parsed.header_length is not None else "http-json/") + version_tag
        return await cache_key_async(protocol, self.call.model, resolved, canonical, tensors, tenant)

    def attempt(
        self,
        version: str | None = None,
        shared: bool = False,
        model: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> Attempt[HttpResponse]:
        wire, call, parsed, body = self.wire, self.call, self.parsed, self.body
        if model is not None and version is not None:  # a cascade's stage of a model in canary
            path = versioned_path(model, version, wire.query)
        elif model is not None:  # a cascade's stage: the same request, to another model
            path = f"/v2/models/{quote(model, safe='')}/infer".encode() + wire.query
        elif version is not None:
            path = versioned_path(call.model, version, wire.query)
        elif call.plan is not None:  # a model in canary: the version chosen for this client
            path = versioned_path(call.model, call.version, wire.query)
        else:
            path = wire.raw_path + wire.query
        forward = wire.forward
        if shared:
            # One stored entry must serve every client: ask Triton for the identity encoding
            # (HTTP lets a server ignore Accept-Encoding), so entries are never gzip bytes.
            forward = [(k, v) for k, v in forward if k != b"accept-encoding"]
        if headers:
            forward = [*forward, *((k.encode(), v.encode()) for k, v in headers)]

        async def attempt(server: UpstreamServer, timeout_s: float) -> HttpResponse:
            if parsed is None:
                return as_client_error(await server.http_request(b"POST", path, body, forward, timeout_s))
            # Triton stops work the gateway has given up on: pass this attempt's bound on. A shared
            # answer is keyed on the request as parsed: Triton reads exactly that (canonical) form.
            data, n = parsed.with_timeout(timeout_s, canonical=shared)
            headers = forward if n is None else [*forward, (HEADER_LENGTH, b"%d" % n)]
            return as_client_error(await server.http_request(b"POST", path, data, headers, timeout_s))

        return attempt

    @staticmethod
    def storable(resp: HttpResponse, resolved: str | None) -> bytes | None:
        if resp.status != 200:
            return None
        try:
            answered = str(_response_header_json(resp)[0].get("model_version", ""))
        except ValueError:
            return None
        # Triton moved to a newer version than the health view knew: do not file it under the old one.
        return encode_entry(resp) if resolved is None or answered == resolved else None

    @staticmethod
    def succeeded(resp: HttpResponse) -> bool:
        return resp.status == 200

    @staticmethod
    def output(resp: HttpResponse, name: str) -> Any:
        return (
            http_output(resp.body, resp.header(HEADER_LENGTH), name, exact=True)
            if resp.status == 200
            else None
        )

    @staticmethod
    def marked(resp: HttpResponse, mark: Mark) -> HttpResponse:
        return mark_answer(resp, mark)

    @staticmethod
    def mark_of(resp: HttpResponse) -> Mark | None:
        try:
            params = _response_header_json(resp)[0].get("parameters")
        except ValueError:
            return None
        return Mark.from_parameters(params) if isinstance(params, dict) else None

    @staticmethod
    def decode(stored: bytes) -> HttpResponse:
        return decode_entry(stored)

    def restamp(self, resp: HttpResponse) -> HttpResponse:
        return restamp_id(resp, self.request_id) if resp.status == 200 else resp

    @staticmethod
    def classes(resp: HttpResponse, output: str) -> list[str] | None:
        return http_classes(resp.body, resp.header(HEADER_LENGTH), output) if resp.status == 200 else None


class AsgiExchange:
    """An infer request under an ASGI server other than the gateway's own protocol."""

    __slots__ = ("receive", "send")

    def __init__(self, receive: Any, send: Any) -> None:
        self.receive = receive
        self.send = send

    @staticmethod
    def whole_body() -> bytes | None:
        return None

    async def receive_chunk(self) -> tuple[bytes, bool] | None:
        message = await self.receive()
        if message["type"] == "http.disconnect":
            return None
        return message.get("body", b""), message.get("more_body", False)

    async def write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})


async def serve_infer(
    gw: Any,
    limits: InferLimits,
    exchange: Exchange,
    headers: list[tuple[bytes, bytes]],
    model: str,
    version: str,
    raw_path: bytes,
    query: bytes,
    client: str,
) -> None:
    """One infer request through the pipeline (gateway/pipeline/run.py): what the protocol calls for
    each infer request, compiled (gateway/fronts/http_front.py binds `gw` and `limits`)."""
    wire = HttpWire(gw, limits, exchange, raw_path, query)
    await run.infer(gw, wire.call(headers, model, version, client, gw.clock()), wire)
