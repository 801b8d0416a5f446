"""Triton's generate extension through the gateway: `/v2/models/{m}[/versions/{v}]/generate` and
`generate_stream`, the endpoints Triton's LLM backends (vLLM, TensorRT-LLM) are called through.

Admission is inference's: the key, the model list and the rate limit before a byte of the body is
read, the body bounded and counted against its caller, JSON Triton would refuse answered 400 here.
`generate` is a request and its answer, routed, retried and deadline-bound like `infer` (never
cached: sampling makes answers differ). `generate_stream` holds one server for the stream's life
(chosen by the balancer; retried elsewhere only before Triton's answer has begun) and passes its
server-sent events on as each arrives, never buffered. A client that goes away closes Triton's
connection, which stops the generation; a server that fails, or a stream idle past
limits.stream_idle_timeout_s, ends the client's stream with an error event in Triton's own shape
(`data: {"error": ...}`), never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import quote

from gateway.core import Gateway
from gateway.errors import (
    BadRequest,
    GatewayError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.fleet.dispatch import Attempt, check_version
from gateway.forward_headers import checked_forward_header, checked_forwarded_total
from gateway.fronts.http_infer import AsgiExchange, InferLimits, error_answer, receive_body
from gateway.fronts.infer_body import OFF_LOOP_BYTES, check_triton_json, inflate_async, inflate_cap
from gateway.fronts.request_id import checked_request_id, is_valid_request_id, new_request_id
from gateway.pipeline import admission, record
from gateway.pipeline.call import Call
from gateway.pipeline.forward import set_deadline
from gateway.upstream.http_client import HttpResponse
from gateway.upstream.server import UpstreamServer
from gateway.upstream.stream_client import StreamedResponse, open_stream

logger = logging.getLogger(__name__)
_RETURN = {b"content-type", b"inference-header-content-length", b"content-encoding"}
_MAX_ERROR_BODY = 64 * 1024  # an error answer read whole before the client's stream begins
# Triton answers a generate body whose values it cannot convert with 500 and this text: the client's fault.
_TRITON_GENERATE_PARSE_ERROR = b'{"error":"Unable to parse'


def parse_generate_path(path: str) -> tuple[str, str, bool] | None:
    """(model, version or '', streamed?) for /v2/models/{m}[/versions/{v}]/generate[_stream]."""
    parts = path.split("/")
    if len(parts) == 5:
        model, version, last = parts[3], "", parts[4]
    elif len(parts) == 7 and parts[4] == "versions":
        model, version, last = parts[3], parts[5], parts[6]
    else:
        return None
    if last == "generate":
        return model, version, False
    if last == "generate_stream":
        return model, version, True
    return None


def _as_client_error(resp: HttpResponse) -> HttpResponse:
    if resp.status == 500 and resp.body.startswith(_TRITON_GENERATE_PARSE_ERROR):
        return HttpResponse(400, resp.headers, resp.body)
    return resp


def sse_error(message: str) -> bytes:
    """An error as Triton's generate_stream sends one: a server-sent event with an `error` field."""
    return b"data: " + json.dumps({"error": message}).encode() + b"\n\n"


class Generation:
    """One generate or generate_stream request as it goes: its `Call` (what admission took, where it
    went, how it ended) and what its wire needs on the way."""

    __slots__ = (
        "call",
        "receive",
        "send",
        "path",
        "forward",
        "extra",
        "encoding",
        "sent_id",
        "request_ids",
        "payload",
    )

    def __init__(self, call: Call, receive: Any, send: Any, path: bytes) -> None:
        self.call = call
        self.receive = receive
        self.send = send
        self.path = path  # as the client sent it; versioned when the gateway pins the stable version
        self.forward: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
        self.extra: list[tuple[bytes, bytes]] = []  # on every answer: the request id
        self.encoding: str | None = None
        self.sent_id: str | None = None  # the last x-request-id sent
        self.request_ids = 0
        # Held in a list the stream empties once Triton has it (minutes of a long generation must
        # not keep the prompt in memory, uncounted).
        self.payload: list[bytes] = []


class GenerateFront:
    def __init__(self, gw: Gateway, limits: InferLimits) -> None:
        self.gw = gw
        self.limits = limits  # the infer path's: body bound, inflation, read timeout, headers
        self.idle_s = gw.cfg.limits.stream_idle_timeout_s

    async def __call__(
        self, scope: dict[str, Any], receive: Any, send: Any, model: str, version: str, streamed: bool
    ) -> None:
        """Admission as every request's (gateway/pipeline/admission.py): the key, the model list and
        the rate limit before a byte of the body; a stream slot before it (a stream), or the
        in-flight slot once it is in (a request); everything given back by `record.finish`."""
        gw = self.gw
        gen = self._generation(scope, receive, send, model, version, streamed)
        call = gen.call
        try:
            self._check_head(gen)
            await admission.enter(gw, call)
            self._pin_stable(gen, streamed)
            if streamed:
                await admission.enter(gw, call, "stream")
                gen.payload.append(await self._body(gen))
                await self._stream(gen)
            else:
                gen.payload.append(await self._body(gen))
                await admission.enter(gw, call, "request")
                await self._generate(gen)
        except Exception as exc:
            if not isinstance(exc, GatewayError):
                logger.exception("unhandled error in generate, request_id=%s", call.request_id)
            call.status = str(await self._error(send, exc, gen.extra, call.request_id))
        finally:
            record.finish(gw, call)

    def _generation(
        self, scope: dict[str, Any], receive: Any, send: Any, model: str, version: str, streamed: bool
    ) -> Generation:
        """The request's head read into its Call (checked by `_check_head`)."""
        call = Call("http_stream" if streamed else "http", self.gw.clock(), model, version, named=True)
        call.client = (scope.get("client") or ("",))[0]
        gen = Generation(call, receive, send, bytes(scope["raw_path"]))
        for k, v in scope["headers"]:
            if k == b"authorization":
                call.authorization = v.decode("latin-1")
            elif k == b"x-api-key":
                call.api_key = v.decode("latin-1")
            elif k == b"x-request-id":
                gen.sent_id = v.decode("latin-1")
                gen.request_ids += 1
            elif k == b"content-encoding":
                gen.encoding = v.decode("latin-1")
            elif k == self.limits.region_header:
                call.pinned = v.decode("latin-1")
            elif k == self.limits.timeout_header:
                call.timeout_ms = v.decode("latin-1")
            elif self.gw.forwarded(k.decode("latin-1")):
                gen.forward.append((k, v))
        # The last one sent, when valid: checked (and refused when wrong) in `_check_head`.
        sent = gen.sent_id
        call.request_id = sent if sent and is_valid_request_id(sent) else new_request_id()
        gen.extra.append((b"x-request-id", call.request_id.encode()))
        return gen

    def _check_head(self, gen: Generation) -> None:
        call = gen.call
        call.version = check_version(call.version)
        if gen.request_ids > 1:
            raise BadRequest(f"send one x-request-id header, got {gen.request_ids}")
        checked_request_id(gen.sent_id)
        gen.forward = [(k, checked_forward_header(k, v)) for k, v in gen.forward]
        checked_forwarded_total(gen.forward)

    def _pin_stable(self, gen: Generation, streamed: bool) -> None:
        """What is forwarded, once the caller is admitted: the request id, the key's own headers
        (auth.keys[].headers); for a model in canary, its stable version in the path."""
        call, gw = gen.call, self.gw
        gen.forward.append((b"x-request-id", call.request_id.encode()))
        if call.principal is not None:
            gen.forward += [(k.encode(), v.encode()) for k, v in call.principal.headers]
        if gw.traffic is not None and not call.version:
            call.version = gw.traffic.stable_pin(call.model, call.version)
            if call.version:
                last = "generate_stream" if streamed else "generate"
                gen.path = f"/v2/models/{quote(call.model, safe='')}/versions/{call.version}/{last}".encode()

    async def _body(self, gen: Generation) -> bytes:
        """The request JSON (inflated), checked as Triton would read it: an object, and nothing
        Triton would answer with a 500 (a lone surrogate, a number beyond a double)."""
        gw, call = self.gw, gen.call
        exchange = AsgiExchange(gen.receive, gen.send)
        limits = self.limits
        body = await receive_body(
            exchange, limits.max_bytes, limits.body_timeout_s, lambda n: admission.hold(gw, call, n)
        )
        encoding = gen.encoding
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            grow = max(inflate_cap(len(body), limits.max_bytes, limits.inflate_ratio) - len(body), 0)
            admission.hold(gw, call, grow)
            body = await inflate_async(body, encoding, limits.max_bytes, limits.inflate_ratio)
        if len(body) > OFF_LOOP_BYTES:
            await asyncio.to_thread(_check_json, body)
        else:
            _check_json(body)
        return body

    @staticmethod
    async def _respond(send: Any, resp: HttpResponse, extra: list[tuple[bytes, bytes]]) -> None:
        headers = [(k.lower(), v) for k, v in resp.headers if k.lower() in _RETURN]
        headers.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers + extra})
        await send({"type": "http.response.body", "body": resp.body})

    @staticmethod
    async def _error(send: Any, exc: BaseException, extra: list[tuple[bytes, bytes]], request_id: str) -> int:
        status, headers, body = error_answer(exc, request_id)
        headers = [*headers, (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return status

    async def _generate(self, gen: Generation) -> None:
        call, gw, path, body, forward = gen.call, self.gw, gen.path, gen.payload[0], gen.forward
        set_deadline(gw, call, None)

        async def attempt(server: UpstreamServer, timeout_s: float) -> HttpResponse:
            return _as_client_error(await server.http_request(b"POST", path, body, forward, timeout_s))

        outcome = await gw.send(call.model, call.version, call.pinned, call.deadline, attempt)
        resp = outcome.value
        call.route = outcome.route
        await self._respond(gen.send, resp, [*gen.extra, *_route_headers(outcome.route.server)])
        call.status = str(resp.status)

    async def _stream(self, gen: Generation) -> None:
        """The stream's server chosen and its answer begun (the deadline bounds that wait; once
        events flow the stream is bounded by its idle time: a long generation is not a slow server),
        then its events passed on until either side ends."""
        call, gw = gen.call, self.gw
        set_deadline(gw, call, None)
        opened: list[StreamedResponse] = []
        try:
            outcome = await gw.send(
                call.model, call.version, call.pinned, call.deadline, self._opener(gen, opened), hedge=False
            )
            # Triton has the request: its bytes no longer count against the caller, nor stay in
            # memory, for the stream's life (minutes, for a long generation).
            gen.payload.clear()
            admission.give_back(gw, call, call.held)
            head, server = outcome.value, outcome.route.server
            call.route = outcome.route
            if head.status != 200:
                await self._respond(gen.send, head, [*gen.extra, *_route_headers(server)])
                call.status = str(head.status)
                return
            headers = [
                (k.lower(), v) for k, v in head.headers if k.lower() in (b"content-type", b"cache-control")
            ]
            await gen.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [*headers, *gen.extra, *_route_headers(server)],
                }
            )
            call.status = await self._pass_on(gen, opened[-1], server)
        finally:
            for stream in opened:
                stream.close()

    def _opener(self, gen: Generation, opened: list[StreamedResponse]) -> Attempt[HttpResponse]:
        """One attempt to open the stream on a server: its head, or its whole error answer."""
        path, forward, payload = gen.path, gen.forward, gen.payload

        async def attempt(server: UpstreamServer, timeout_s: float) -> HttpResponse:
            # One bound for the whole attempt: the head, and an error answer's body after it. Its
            # expiry is the dispatcher's UpstreamTimeout (counted against the server only when the
            # gateway's own bound, not the client's deadline, ran out; retried elsewhere then).
            try:
                async with asyncio.timeout(timeout_s):
                    stream = await open_stream(server.http, path, payload[0], forward)
                    opened.append(stream)
                    head = await stream.head(timeout_s)
                    if head.status != 200:
                        return _as_client_error(
                            HttpResponse(head.status, head.headers, await stream.rest(_MAX_ERROR_BODY))
                        )
                    return head
            except TimeoutError:
                raise UpstreamTimeout(f"{server.name}: no answer begun within {timeout_s:.3f}s") from None

        return attempt

    async def _pass_on(self, gen: Generation, stream: StreamedResponse, server: UpstreamServer) -> str:
        """Triton's events to the client until the stream ends or the client goes; the status label."""
        server.open_streams += 1
        relay = asyncio.ensure_future(self._relay(stream, gen.send, server))
        gone = asyncio.ensure_future(_disconnected(gen.receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                return relay.result()
            return "499"  # the client went away: closing Triton's connection stops the generation
        finally:
            server.open_streams -= 1
            for task in (relay, gone):
                task.cancel()
            # Waited for without raising their errors, and without swallowing this task's own cancel.
            await asyncio.wait({relay, gone})

    async def _relay(self, stream: StreamedResponse, send: Any, server: UpstreamServer) -> str:
        """Triton's events on to the client as they arrive; an error event at a failure or idle end.
        Every send is bounded too: a client that stops reading is let go after the idle bound."""
        while True:
            try:
                data = await asyncio.wait_for(stream.chunk(), self.idle_s)
            except asyncio.TimeoutError:
                end = sse_error(
                    f"no event for {self.idle_s:g}s (limits.stream_idle_timeout_s); stream closed"
                )
                await self._send(send, end, last=True)
                return "504"
            except UpstreamUnavailable as exc:
                self.gw.detector.failure(server, exc.message, self.gw.clock())
                end = sse_error(f"server {server.name} failed during the stream: {exc.message}")
                await self._send(send, end, last=True)
                return "502"
            if data is None:
                return "200" if await self._send(send, b"", last=True) else "408"
            if not await self._send(send, data, last=False):
                return "408"

    async def _send(self, send: Any, data: bytes, last: bool) -> bool:
        """One piece of the response body; False when the client read nothing for the idle bound."""
        try:
            await asyncio.wait_for(
                send({"type": "http.response.body", "body": data, "more_body": not last}), self.idle_s
            )
        except asyncio.TimeoutError:
            return False
        return True


async def _disconnected(receive: Any) -> None:
    """Returns when the client has gone (the body was read already: nothing else can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _route_headers(server: UpstreamServer) -> list[tuple[bytes, bytes]]:
    return [(b"x-skewserve-region", server.region.encode()), (b"x-skewserve-server", server.name.encode())]


def _check_json(body: bytes) -> None:
    try:
        text = body.decode()
        value = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the generate request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest(f"the generate request body must be a JSON object, got {type(value).__name__}")
    check_triton_json(text)
