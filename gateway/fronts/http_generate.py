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
from typing import Any, Protocol
from urllib.parse import quote

from gateway.core import Gateway
from gateway.errors import BadRequest, GatewayError, Overloaded, UpstreamTimeout, UpstreamUnavailable
from gateway.fronts.forward_headers import checked_forward_header, checked_forwarded_total
from gateway.fronts.infer_body import OFF_LOOP_BYTES, check_triton_json, inflate_async, inflate_cap
from gateway.fronts.request_id import checked_request_id, is_valid_request_id, new_request_id
from gateway.pipeline.dispatch import check_version
from gateway.upstream.http_client import HttpResponse
from gateway.upstream.server import UpstreamServer
from gateway.upstream.stream_client import StreamedResponse, open_stream

logger = logging.getLogger(__name__)
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


class HttpFrontParts(Protocol):
    """What generate shares with the infer path of gateway/fronts/http_front.py (a protocol rather than
    the class: that module imports this one)."""

    gw: Gateway
    region_header: bytes
    timeout_header: bytes
    max_bytes: int
    inflate_ratio: float

    async def _read_body(self, receive: Any, caller: str, held: list[int]) -> bytes: ...

    async def _respond(self, send: Any, resp: HttpResponse, extra: list[tuple[bytes, bytes]]) -> None: ...

    async def _error(
        self, send: Any, exc: BaseException, extra: list[tuple[bytes, bytes]], request_id: str
    ) -> int: ...


class GenerateFront:
    def __init__(self, front: HttpFrontParts) -> None:
        self.front = front
        self.gw = front.gw
        self.idle_s = self.gw.cfg.limits.stream_idle_timeout_s

    async def __call__(
        self, scope: dict[str, Any], receive: Any, send: Any, model: str, version: str, streamed: bool
    ) -> None:
        gw = self.gw
        started = gw.clock()
        sent: dict[bytes, str] = {}
        forward: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
        request_ids = 0
        for k, v in scope["headers"]:
            if k in (b"authorization", b"x-api-key", b"x-request-id", b"content-encoding"):
                sent[k] = v.decode("latin-1")
                request_ids += k == b"x-request-id"
            elif k == self.front.region_header:
                sent[b"pin"] = v.decode("latin-1")
            elif k == self.front.timeout_header:
                sent[b"timeout"] = v.decode("latin-1")
            elif gw.forwarded(k.decode("latin-1")):
                forward.append((k, v))
        request_id = sent.get(b"x-request-id")
        request_id = request_id if request_id and is_valid_request_id(request_id) else new_request_id()
        extra = [(b"x-request-id", request_id.encode())]
        status = "500"
        where = ["", ""]  # region, server
        caller = ""
        held = [0]
        try:
            version = check_version(version)
            if request_ids > 1:
                raise BadRequest(f"send one x-request-id header, got {request_ids}")
            checked_request_id(sent.get(b"x-request-id"))
            forward = [(k, checked_forward_header(k, v)) for k, v in forward]
            checked_forwarded_total(forward)
            if gw.refusing:
                raise Overloaded("gateway is shutting down; retry on another replica")
            client = (scope.get("client") or ("",))[0]
            principal = await gw.check_caller(
                model, sent.get(b"authorization"), sent.get(b"x-api-key"), client
            )
            caller = gw.caller_of(principal, client)
            forward.append((b"x-request-id", request_id.encode()))
            if principal is not None:  # the key's own headers (auth.keys[].headers)
                forward += [(k.encode(), v.encode()) for k, v in principal.headers]
            path = bytes(scope["raw_path"])
            if gw.traffic is not None and not version:  # a model in canary: its stable version
                version = gw.traffic.stable_pin(model, version)
                if version:
                    last = "generate_stream" if streamed else "generate"
                    path = f"/v2/models/{quote(model, safe='')}/versions/{version}/{last}".encode()
            if streamed:
                with gw.streams.hold(caller):
                    # Held in a list the stream empties once Triton has it (minutes of a long
                    # generation must not keep the prompt in memory, uncounted).
                    payload = [await self._body(receive, caller, held, sent.get(b"content-encoding"))]
                    status = await self._stream(
                        receive,
                        send,
                        model,
                        version,
                        sent,
                        path,
                        payload,
                        forward,
                        extra,
                        where,
                        caller,
                        held,
                    )
            else:
                body = await self._body(receive, caller, held, sent.get(b"content-encoding"))
                gw.inflight += 1
                try:
                    gw.check_slot()
                    status = await self._generate(
                        send, model, version, sent, path, body, forward, extra, where
                    )
                finally:
                    gw.inflight -= 1
        except GatewayError as exc:
            status = str(await self.front._error(send, exc, extra, request_id))
        except Exception as exc:
            logger.exception("unhandled error in generate, request_id=%s", request_id)
            status = str(await self.front._error(send, exc, extra, request_id))
        finally:
            gw.bodies.release(caller, held[0])
            protocol = "http_stream" if streamed else "http"
            gw.metrics.request(model, where[0], where[1], protocol, status, gw.clock() - started)

    async def _body(self, receive: Any, caller: str, held: list[int], encoding: str | None) -> bytes:
        """The request JSON (inflated), checked as Triton would read it: an object, and nothing
        Triton would answer with a 500 (a lone surrogate, a number beyond a double)."""
        front = self.front
        body = await front._read_body(receive, caller, held)
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            grow = max(inflate_cap(len(body), front.max_bytes, front.inflate_ratio) - len(body), 0)
            self.gw.bodies.reserve(caller, grow)
            held[0] += grow
            body = await inflate_async(body, encoding, front.max_bytes, front.inflate_ratio)
        if len(body) > OFF_LOOP_BYTES:
            await asyncio.to_thread(_check_json, body)
        else:
            _check_json(body)
        return body

    async def _generate(
        self,
        send: Any,
        model: str,
        version: str,
        sent: dict[bytes, str],
        path: bytes,
        body: bytes,
        forward: list[tuple[bytes, bytes]],
        extra: list[tuple[bytes, bytes]],
        where: list[str],
    ) -> str:
        gw = self.gw
        deadline = gw.deadline(sent.get(b"timeout"), None, model)

        async def attempt(server: UpstreamServer, timeout_s: float) -> HttpResponse:
            return _as_client_error(await server.http_request(b"POST", path, body, forward, timeout_s))

        outcome = await gw.send(model, version, sent.get(b"pin"), deadline, attempt)
        resp = outcome.value
        where[:] = [outcome.route.region, outcome.route.server.name]
        await self.front._respond(send, resp, [*extra, *_route_headers(outcome.route.server)])
        return str(resp.status)

    async def _stream(
        self,
        receive: Any,
        send: Any,
        model: str,
        version: str,
        sent: dict[bytes, str],
        path: bytes,
        payload: list[bytes],
        forward: list[tuple[bytes, bytes]],
        extra: list[tuple[bytes, bytes]],
        where: list[str],
        caller: str,
        held: list[int],
    ) -> str:
        gw = self.gw
        # The deadline bounds the wait for Triton's answer to begin; once events flow the stream
        # is bounded by its idle time instead (a long generation is not a slow server).
        deadline = gw.deadline(sent.get(b"timeout"), None, model)
        opened: list[StreamedResponse] = []

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

        try:
            outcome = await gw.send(model, version, sent.get(b"pin"), deadline, attempt, hedge=False)
            # Triton has the request: its bytes no longer count against the caller, nor stay in
            # memory, for the stream's life (minutes, for a long generation).
            payload.clear()
            gw.bodies.release(caller, held[0])
            held[0] = 0
            head, server = outcome.value, outcome.route.server
            where[:] = [outcome.route.region, server.name]
            if head.status != 200:
                await self.front._respond(send, head, [*extra, *_route_headers(server)])
                return str(head.status)
            headers = [
                (k.lower(), v) for k, v in head.headers if k.lower() in (b"content-type", b"cache-control")
            ]
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [*headers, *extra, *_route_headers(server)],
                }
            )
            server.open_streams += 1
            relay = asyncio.ensure_future(self._relay(opened[-1], send, server))
            gone = asyncio.ensure_future(_disconnected(receive))
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
        finally:
            for stream in opened:
                stream.close()

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
