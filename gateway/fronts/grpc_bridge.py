"""The worker end of the HAProxy gRPC data plane: gRPC calls arriving as HTTP/1.1 on a unix socket.

HAProxy (gateway/upstream/haproxy.py) turns each client HTTP/2 stream into one HTTP/1.1 request: the path
names the method, headers carry the metadata and `grpc-timeout`, the chunked body the
length-prefixed message. This module parses that with httptools, runs the same `GrpcFront`
handlers grpc.aio runs (through `BridgeContext`, the part of `grpc.aio.ServicerContext` they use),
and answers with the message and `grpc-status` trailers in a chunked response, which HAProxy turns
back into HTTP/2 DATA and trailing HEADERS. A client that resets its stream closes this connection
(HAProxy cannot abort an HTTP/1.1 request otherwise), which cancels the handler like grpc.aio would.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import grpc
import httptools

from gateway.config import LimitsConfig
from gateway.connection_timer import ConnectionTimer
from gateway.errors import BridgeAbort, GatewayError, UnsupportedEncoding, grpc_code_for
from gateway.fronts.infer_body import inflate, inflate_cap
from gateway.state.body_budget import BodyBudget
from gateway.upstream.haproxy import PEER_HEADER

logger: Final = logging.getLogger(__name__)

Handler = Callable[[bytes, Any], Awaitable[bytes]]
_PREFIX: Final = 5  # compressed flag + 4-byte big-endian length
_LINGER_S: Final = 1.0  # a refused request's connection closes once the request is read, or after this
_OFF_LOOP_BYTES: Final = 64 * 1024  # larger compressed messages are inflated in a worker thread
_RECEIVING: Final = 1  # the connection timer's one wait: a request still arriving
# Transport headers, not call metadata (grpc.aio does not show them to handlers either).
_NOT_METADATA: Final = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "transfer-encoding",
        "te",
        "user-agent",
        "grpc-timeout",
        "grpc-encoding",
        "grpc-accept-encoding",
        "connection",
        PEER_HEADER,
    }
)
_UNIT_S: Final = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_RESPONSE_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
)


class BridgeContext:
    """What `GrpcFront` handlers read and set on a call, for a call that came through HAProxy."""

    __slots__ = ("_metadata", "_peer", "_deadline", "_loop", "trailing", "precheck")

    def __init__(
        self,
        metadata: tuple[tuple[str, str], ...],
        peer: str,
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
        precheck: Precheck | None = None,
    ) -> None:
        self._metadata = metadata
        self._peer = peer
        self._deadline = deadline  # on `loop`'s clock
        # Held: on Python 3.11 asyncio.get_running_loop() makes a getpid system call.
        self._loop = loop
        self.trailing: tuple[tuple[str, str], ...] = ()
        # Set when the bridge checked the key and rate limit from the headers (GrpcFront reads it).
        self.precheck = precheck

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._loop.time())

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise BridgeAbort(code, details)


def parse_grpc_timeout(value: str) -> float:
    """Seconds from a `grpc-timeout` header ('100m', '5S'); BridgeAbort naming it when malformed."""
    digits, unit = value[:-1], _UNIT_S.get(value[-1:])
    if unit is None or not 1 <= len(digits) <= 8 or not (digits.isascii() and digits.isdigit()):
        raise BridgeAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"grpc-timeout {value[:40]!r} is malformed: send 1 to 8 digits and a unit (H M S m u n)",
        )
    return int(digits) * unit


def unframe(body: bytes, max_bytes: int) -> tuple[bool, bytes]:
    """(compressed?, the one message) of a unary call's body; BridgeAbort naming what is wrong otherwise."""
    if len(body) < _PREFIX:
        raise BridgeAbort(grpc.StatusCode.INTERNAL, "the request body holds no gRPC message")
    if body[0] not in (0, 1):
        raise BridgeAbort(grpc.StatusCode.INTERNAL, f"gRPC message flag {body[0]} is not 0 or 1")
    length = int.from_bytes(body[1:_PREFIX], "big")
    if length > max_bytes:
        raise BridgeAbort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"received message larger than max ({length} vs. {max_bytes}) (limits.max_request_bytes)",
        )
    if len(body) != _PREFIX + length:
        raise BridgeAbort(
            grpc.StatusCode.INTERNAL,
            f"the request body holds {len(body) - _PREFIX} bytes after the message prefix, which says {length}; "
            "send exactly one message per unary call",
        )
    return body[0] == 1, body[_PREFIX:]


async def decompress(message: bytes, encoding: str | None, limit: int, ratio: float) -> bytes:
    """A compressed message inflated (gzip or deflate, as grpc-core sends), within the HTTP bounds."""
    if not encoding or encoding == "identity":
        raise BridgeAbort(
            grpc.StatusCode.INTERNAL, "the message is flagged compressed but grpc-encoding names none"
        )
    try:
        if len(message) > _OFF_LOOP_BYTES:
            return await asyncio.to_thread(inflate, message, encoding, limit, ratio)
        return inflate(message, encoding, limit, ratio)
    except UnsupportedEncoding:
        raise BridgeAbort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"grpc-encoding {encoding[:40]!r} is not supported; use gzip or deflate",
        ) from None
    except GatewayError as exc:
        raise BridgeAbort(grpc_code_for(exc), exc.message.replace("request body", "message")) from None


def _percent_encode(message: str) -> bytes:
    # gRPC's grpc-message encoding: printable ASCII except '%' as is, everything else %XX of UTF-8.
    return urllib.parse.quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")


def _trailers(code: grpc.StatusCode, message: str, metadata: Sequence[tuple[str, str]]) -> bytes:
    lines = [b"grpc-status: %d\r\n" % code.value[0]]
    if message:
        lines.append(b"grpc-message: " + _percent_encode(message) + b"\r\n")
    for k, v in metadata:
        lines.append(k.encode("ascii") + b": " + v.encode("ascii") + b"\r\n")
    return b"".join(lines)


def encode_response(
    message: bytes | None, code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, str]]
) -> bytes:
    """A chunked HTTP/1.1 response: the framed message (if any), then the status as trailers."""
    parts = [_RESPONSE_HEAD]
    if message is not None:
        framed_len = _PREFIX + len(message)
        parts += [b"%x\r\n" % framed_len, b"\x00", len(message).to_bytes(4, "big"), message, b"\r\n"]
    parts += [b"0\r\n", _trailers(code, details, metadata), b"\r\n"]
    return b"".join(parts)


class Precheck:
    """What a call's headers settled before its message arrived: whom its bytes count against, the
    key's principal, and the rate-limit check under way (None where the method needs no key)."""

    __slots__ = ("caller", "principal", "rate")

    def __init__(self, caller: str, principal: Any = None, rate: asyncio.Future[None] | None = None) -> None:
        self.caller = caller
        self.principal = principal
        self.rate = rate


# (method path, lowercased headers) -> Precheck; raises GatewayError to refuse the call unread.
Gate = Callable[[bytes, list[tuple[str, str]]], Precheck]


class _Call:
    __slots__ = ("path", "headers", "body", "size", "pre")

    def __init__(self) -> None:
        self.path = b""
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.pre = Precheck("")


class BridgeProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection from HAProxy; requests on it come one at a time."""

    def __init__(self, server: BridgeServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.call = _Call()
        self.task: asyncio.Task[None] | None = None
        self.refused = False
        self.linger: asyncio.TimerHandle | None = None  # the close of a refused request
        self.headers_done = False
        # Bounds each request's reading (limits.body_read_timeout_s), one timer for the connection.
        self.body_timer = ConnectionTimer(asyncio.get_running_loop(), self._too_slow)
        self.receiving = 0  # this request's bytes counted in server.receiving

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._stop_receiving()
        self.body_timer.close()
        if self.linger is not None:
            self.linger.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client reset its stream or went away

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            logger.warning("gRPC bridge: malformed request from HAProxy (%s); closing", exc)
            self._close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.headers_done = False
        # A client that opens a stream and then sends nothing (or a trickle) holds a worker
        # connection: bounded like an HTTP body (limits.body_read_timeout_s).
        self.body_timer.arm(_RECEIVING, self.server.body_timeout_s)

    def on_url(self, url: bytes) -> None:
        self.call.path += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools reports a chunked body's trailers here too; HAProxy rewrites only the headers
        # (x-skewserve-peer among them), so whatever comes after them is the client's and ignored.
        if not self.headers_done:
            self.call.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.refused:
            return
        call = self.call
        if call.path not in self.server.handlers:
            # At once, by name: a streaming client (ModelStreamInfer) would otherwise wait with its
            # stream open until the body timer ran out.
            self._refuse(
                grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {call.path.decode('latin-1')[:200]}"
            )
            return
        gate = self.server.gate
        if gate is None:
            return
        # The key and the rate limit are settled from the headers, before a byte of the message is
        # held or inflated: a caller refused here costs a hash and a token, never a slot or memory.
        try:
            call.pre = gate(call.path, call.headers)
        except GatewayError as exc:
            self._refuse(grpc_code_for(exc), exc.message)
            return
        rate = call.pre.rate
        if rate is not None:
            rate.add_done_callback(lambda done: self._rate_checked(call, done))

    def _rate_checked(self, call: _Call, done: asyncio.Future[None]) -> None:
        exc = None if done.cancelled() else done.exception()  # retrieved here, whoever else awaits it
        if isinstance(exc, GatewayError) and self.call is call and self.headers_done:
            self._refuse(grpc_code_for(exc), exc.message)  # still receiving: refused unread

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        call = self.call
        call.size += len(body)
        if call.size > self.server.max_body_bytes:
            self._refuse(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"received message larger than max ({self.server.max_request_bytes} bytes, "
                "limits.max_request_bytes)",
            )
            return
        try:
            self.server.budget.reserve(call.pre.caller, len(body))
        except GatewayError as exc:
            self._refuse(grpc_code_for(exc), exc.message)
            return
        self.receiving += len(body)
        call.body.append(body)

    def on_message_complete(self) -> None:
        self._stop_receiving()
        call, self.call = self.call, _Call()
        self.headers_done = False
        if self.refused:  # already answered; the connection carries the next request
            self.refused = False
            if self.linger is not None:
                self.linger.cancel()
                self.linger = None
            return
        # A task per call, not the HTTP front's eager start: on gRPC cache hits at concurrency 8,
        # answering from this callback cost 9% more CPU per call and 8% less throughput
        # (docs/benchmarks.md). Likely why: with a task, one loop turn reads every ready connection
        # before any answer wakes HAProxy, so HAProxy handles several answers per wake-up.
        self.task = self.body_timer.loop.create_task(self.server.handle(self, call))

    def _too_slow(self, wait: int) -> None:
        self._refuse(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request message was not received within {self.server.body_timeout_s:g}s "
            "(limits.body_read_timeout_s)",
        )

    def _refuse(self, code: grpc.StatusCode, message: str) -> None:
        """Answer now; the rest of the request is discarded as it comes. A request that ends within
        _LINGER_S leaves the connection reusable (HAProxy pools it: closing it would fail the next
        call sent on it); one that does not is closed then, and HAProxy resets the client's stream."""
        if not self.refused:
            self.refused = True
            self.write(encode_response(None, code, message, ()))
            self.linger = asyncio.get_running_loop().call_later(_LINGER_S, self._close)
        self._stop_receiving()

    def _stop_receiving(self) -> None:
        self.body_timer.disarm(_RECEIVING)
        self.server.budget.release(self.call.pre.caller, self.receiving)
        self.receiving = 0

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close(self) -> None:
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        if self.transport is not None:
            self.transport.close()


class BridgeServer:
    """Serves `GrpcFront` methods to HAProxy on a unix socket."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        service: str,
        limits: LimitsConfig,
        budget: BodyBudget | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.handlers = {f"/{service}/{name}".encode(): fn for name, fn in handlers.items()}
        self.max_request_bytes = limits.max_request_bytes
        self.inflate_ratio = limits.max_inflate_ratio
        self.body_timeout_s = limits.body_read_timeout_s
        self.max_body_bytes = limits.max_request_bytes + _PREFIX
        # Bytes of messages still arriving and being inflated, counted with the worker's HTTP bodies
        # (handled messages count in GrpcFront).
        self.budget = budget or BodyBudget(limits.max_buffered_body_bytes, limits.per_caller_body_bytes)
        self.gate = gate
        self.connections: set[BridgeProtocol] = set()
        self.server: asyncio.AbstractServer | None = None

    async def start(self, path: Path) -> None:
        loop = asyncio.get_running_loop()
        path.unlink(missing_ok=True)
        self.server = await loop.create_unix_server(lambda: BridgeProtocol(self), str(path), backlog=2048)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn._close()

    async def handle(self, conn: BridgeProtocol, call: _Call) -> None:
        context: BridgeContext | None = None
        code = grpc.StatusCode.OK
        try:
            handler = self.handlers.get(call.path)
            if handler is None:
                raise BridgeAbort(
                    grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {call.path.decode('latin-1')[:200]}"
                )
            context = self._context(call, conn.body_timer.loop)
            compressed, request = unframe(b"".join(call.body), self.max_request_bytes)
            if compressed:
                request = await self._inflate(call, request)
            response = await handler(request, context)
            conn.write(encode_response(response, grpc.StatusCode.OK, "", context.trailing))
        except BridgeAbort as exc:
            code = exc.code
            trailing = context.trailing if context is not None else ()
            try:
                conn.write(encode_response(None, exc.code, exc.details, trailing))
            except (UnicodeEncodeError, ValueError):  # a trailer that cannot be sent: the status alone
                conn.write(encode_response(None, exc.code, exc.details, ()))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.UNKNOWN
            logger.exception("unhandled error in the gRPC bridge")
            conn.write(encode_response(None, grpc.StatusCode.UNKNOWN, "Unexpected error in the gateway", ()))
        finally:
            # Method and status only: metadata (keys among it) never reaches the log.
            logger.debug("gRPC %s: %s", call.path.decode("latin-1")[:120], code.name)

    async def _inflate(self, call: _Call, message: bytes) -> bytes:
        """The message inflated, its largest possible size counted against the caller meanwhile."""
        encoding = next((v for k, v in call.headers if k == "grpc-encoding"), None)
        cap = inflate_cap(len(message), self.max_request_bytes, self.inflate_ratio)
        try:
            self.budget.reserve(call.pre.caller, cap)
        except GatewayError as exc:
            raise BridgeAbort(grpc_code_for(exc), exc.message) from None
        try:
            return await decompress(message, encoding, self.max_request_bytes, self.inflate_ratio)
        finally:
            self.budget.release(call.pre.caller, cap)

    @staticmethod
    def _context(call: _Call, loop: asyncio.AbstractEventLoop) -> BridgeContext:
        metadata: list[tuple[str, str]] = []
        peer = ""
        deadline: float | None = None
        for name, value in call.headers:
            if name == PEER_HEADER:
                peer = f"ipv6:[{value}]:0" if ":" in value else f"ipv4:{value}:0"
            elif name == "grpc-timeout":
                deadline = loop.time() + parse_grpc_timeout(value)
            elif name not in _NOT_METADATA and not name.endswith("-bin"):
                metadata.append((name, value))
        return BridgeContext(tuple(metadata), peer, deadline, loop, call.pre)
