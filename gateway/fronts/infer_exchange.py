"""One infer request on the gateway's HTTP protocol: what uvicorn's request cycle keeps that the
protocol reads, and the answer written in one send.

Its own module so that it compiles (gateway/compiled_build.py): the protocol that creates it
subclasses uvicorn's, which keeps that module interpreted, but every request reads its body through
this object and writes its answer with `write`, whose head is built here.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable
from typing import Any, Final

import httptools
from uvicorn.protocols.http import httptools_impl

from gateway.fronts.http_infer import parse_infer_path

# uvicorn's own tables, bound here as Final: compiled code reads a Final as a C static, an imported
# name by a lookup in the module's dict on every response.
HEADER_VALUE_RE: Final = httptools_impl.HEADER_VALUE_RE
STATUS_LINE: Final = httptools_impl.STATUS_LINE
COALESCE_BYTES: Final = 64 * 1024  # larger writes go straight out (joining would copy them)


# What HEADER_VALUE_RE refuses in a header value, as a table for bytes.translate: deleting them and
# comparing lengths costs about 1,700 instructions per response, the regex search 2,850.
_CONTROL: Final = bytes([*range(0x09), *range(0x0A, 0x20), 0x7F])


class DefaultsBlock:
    """uvicorn's default headers (date, server) as the head's lines, written once per list: uvicorn
    puts a new list in place each second (the date), and every response in between shares it."""

    def __init__(self) -> None:
        self.source: list[tuple[bytes, bytes]] | None = None
        self.lines = b""

    def block(self, defaults: list[tuple[bytes, bytes]]) -> bytes:
        if defaults is not self.source:
            self.lines = b"".join([name + b": " + value + b"\r\n" for name, value in defaults])
            self.source = defaults
        return self.lines


_DEFAULTS: Final = DefaultsBlock()


def _ignore() -> None:
    pass


# What `infer_target` made of each URL seen: a keep-alive client sends the same few URLs, and
# parsing one costs about 5,000 instructions. Bounded in entries and in URL length, so a client
# sending ever new URLs only empties and refills it.
_TARGETS: Final[dict[bytes, tuple[str, str, bytes, bytes] | None]] = {}
TARGETS_MAX: Final = 1024
TARGET_URL_MAX: Final = 256


def infer_target(url: bytes) -> tuple[str, str, bytes, bytes] | None:
    """(model, version, raw path, query) when `url` is an infer request's, else None."""
    if url in _TARGETS:
        return _TARGETS[url]
    target = _parse_target(url)
    if len(url) <= TARGET_URL_MAX:
        if len(_TARGETS) >= TARGETS_MAX:
            _TARGETS.clear()
        _TARGETS[url] = target
    return target


def _parse_target(url: bytes) -> tuple[str, str, bytes, bytes] | None:
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        return None
    # Read untyped: httptools' stubs say bytes, and compiled code would refuse the None a URL
    # without a query (or a path) has.
    raw_path: Any = getattr(parsed, "path", None)
    query: Any = getattr(parsed, "query", None)
    if not isinstance(raw_path, bytes) or not raw_path.isascii():
        return None
    path = raw_path.decode("ascii")
    target = parse_infer_path(urllib.parse.unquote(path) if "%" in path else path)
    if target is None:
        return None
    return target[0], target[1], raw_path, query if isinstance(query, bytes) else b""


class BodySignal:
    """asyncio.Event's set, clear and wait for the one reader of a request's body, made into an Event
    only when that reader has to wait: most bodies arrive with their headers, and nobody waits."""

    __slots__ = ("flag", "event")

    def __init__(self) -> None:
        self.flag = False
        self.event: asyncio.Event | None = None

    def set(self) -> None:
        self.flag = True
        if self.event is not None:
            self.event.set()

    def clear(self) -> None:
        self.flag = False
        if self.event is not None:
            self.event.clear()

    async def wait(self) -> None:
        if self.flag:
            return
        if self.event is None:
            self.event = asyncio.Event()
        await self.event.wait()


class InferExchange:
    """One infer request on the protocol: the state uvicorn's request cycle keeps that the protocol
    reads (so its flow control, keep-alive, pipelining and disconnect handling apply unchanged),
    without its ASGI scope and messages."""

    __slots__ = (
        "transport",
        "flow",
        "logger",
        "default_headers",
        "message_event",
        "on_response",
        "disconnected",
        "keep_alive",
        "waiting_for_100_continue",
        "body",
        "more_body",
        "response_started",
        "response_complete",
        "target",
        "headers",
        "client",
    )

    def __init__(
        self,
        transport: Any,
        flow: Any,
        logger: Any,
        default_headers: list[tuple[bytes, bytes]],
        on_response: Callable[[], None],
        expect_100_continue: bool,
        keep_alive: bool,
        target: tuple[str, str, bytes, bytes],
        headers: list[tuple[bytes, bytes]],
        client: str,
    ) -> None:
        """Given what the protocol holds (gateway/fronts/http_protocol.py), read there from its native
        copies: read here from the protocol, each was a generic attribute lookup."""
        self.transport = transport
        self.flow = flow
        self.logger = logger
        self.default_headers = default_headers
        self.message_event = BodySignal()
        self.on_response = on_response
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = bytearray()
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.target = target  # model, version, raw path, query
        self.headers = headers
        self.client = client

    async def run_asgi(self, app: Any) -> None:
        """Started by the protocol as it starts an ASGI request (now, or once pipelined ones are done)."""
        try:
            await app.infer(self, self.headers, *self.target, self.client)
        except BaseException as exc:
            self.logger.error("exception in the infer path", exc_info=exc)
            if not self.response_started and not self.disconnected:
                await self.write(
                    500, [(b"content-type", b"application/json")], b'{"error":"internal gateway error"}'
                )
            else:
                self.transport.close()
        finally:
            self.on_response = _ignore

    def whole_body(self) -> bytes | None:
        if self.more_body or self.disconnected or self.response_complete or self.waiting_for_100_continue:
            return None
        body = bytes(self.body)
        self.body = bytearray()
        return body

    async def receive_chunk(self) -> tuple[bytes, bool] | None:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            if self.more_body or not self.body:
                self.flow.resume_reading()
                await self.message_event.wait()
                self.message_event.clear()
        if self.disconnected or self.response_complete:
            return None
        chunk = bytes(self.body)
        self.body = bytearray()
        return chunk, self.more_body

    async def write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole response in one write (the head joined to bodies under COALESCE_BYTES)."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_started:
            return
        try:
            head = self._head(status, headers, len(body))
        except Exception:
            self.transport.close()  # nothing was sent: the client sees the connection end, not a hang
            raise
        self.response_started = True
        self.waiting_for_100_continue = False
        if len(body) < COALESCE_BYTES:
            self.transport.write(head + body)
        else:
            self.transport.write(head)
            self.transport.write(body)
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], length: int) -> bytes:
        # One check over every value (a tab joins them: the one control character a value may
        # hold); the per-header search only names a bad one.
        values = b"\t".join([value for _, value in headers])
        if len(values.translate(None, _CONTROL)) != len(values):
            for name, value in headers:
                if HEADER_VALUE_RE.search(value):  # Triton's or the gateway's: never a split response
                    raise ValueError(f"invalid value of response header {name!r}")
        parts = [STATUS_LINE[status], _DEFAULTS.block(self.default_headers)]
        closing = False
        for name, value in headers:
            if name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                closing = True
            parts.append(name)
            parts.append(b": ")
            parts.append(value)
            parts.append(b"\r\n")
        if not self.keep_alive and not closing:
            parts.append(b"connection: close\r\n")
        parts.append(b"content-length: %d\r\n\r\n" % length)
        return b"".join(parts)
