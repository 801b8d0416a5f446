"""A streamed HTTP/1.1 response from Triton: the head at once, then the body chunk by chunk as it
arrives (generate_stream's server-sent events), never the whole body first.

One connection per stream, closed at its end: a stream lives for seconds to minutes, so a pooled
connection saves nothing, and closing it is how a cancelled stream tells Triton to stop. A reader
that falls behind stops this connection's reads (TCP flow control holds Triton), so a slow client
costs a bounded buffer, not memory without end.
"""

from __future__ import annotations

import asyncio
from collections import deque

import httptools

from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.upstream.http_client import HttpPool, HttpResponse

_HIGH_WATER = 256 * 1024  # bytes buffered before reads from Triton pause


class StreamedResponse(asyncio.Protocol):
    """One request's response: `head()` (status, headers), then `chunk()` until it returns None."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        loop = asyncio.get_running_loop()
        self._head: asyncio.Future[HttpResponse] = loop.create_future()
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._ready = asyncio.Event()
        self._done = False
        self._error: Exception | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(UpstreamUnavailable(f"{self.address}: malformed HTTP response ({exc})"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done:
            self._end(UpstreamUnavailable(f"{self.address}: the server closed the stream before its end"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def _interim(self) -> bool:
        """An interim (1xx) answer: the final one follows on this connection (RFC 9110 15.2)."""
        status = self.parser.get_status_code()
        return 100 <= status < 200 and status != 101

    def on_headers_complete(self) -> None:
        if self._interim():
            self._headers = []
        elif not self._head.done():
            self._head.set_result(HttpResponse(self.parser.get_status_code(), self._headers, b""))

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._ready.set()
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._interim():
            return
        self._done = True
        self._ready.set()

    def _end(self, error: Exception) -> None:
        self._done = True
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._ready.set()

    # the reader's side
    async def head(self, timeout_s: float) -> HttpResponse:
        """Status and headers; UpstreamTimeout / UpstreamUnavailable when they do not come."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._head), timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise UpstreamTimeout(f"{self.address}: no response within {timeout_s:.3f}s") from None

    async def chunk(self) -> bytes | None:
        """The next body bytes as they came; None at the body's end; UpstreamUnavailable when the
        server went away before it."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return None
            self._ready.clear()
            await self._ready.wait()
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered <= _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def rest(self, limit: int) -> bytes:
        """The whole remaining body (an error answer), at most `limit` bytes of it."""
        parts: list[bytes] = []
        size = 0
        while size < limit and (data := await self.chunk()) is not None:
            parts.append(data)
            size += len(data)
        return b"".join(parts)[:limit]

    def close(self) -> None:
        self._done = True
        if self.transport is not None:
            self.transport.close()


async def open_stream(
    pool: HttpPool, path: bytes, body: bytes, headers: list[tuple[bytes, bytes]]
) -> StreamedResponse:
    """POST `body` to `path` on a new connection to the pool's server; the response streams in.
    UpstreamUnavailable when the server cannot be reached."""
    loop = asyncio.get_running_loop()
    try:
        _, stream = await asyncio.wait_for(
            loop.create_connection(lambda: StreamedResponse(pool.address), pool.host, pool.port),
            pool.connect_timeout_s,
        )
    except (OSError, asyncio.TimeoutError) as exc:
        raise UpstreamUnavailable(
            f"{pool.address}: cannot connect ({exc.__class__.__name__}: {exc})"
        ) from exc
    head = [b"POST ", path, b" HTTP/1.1\r\nHost: ", pool.address.encode(), b"\r\nConnection: close\r\n"]
    head += [b"Content-Length: ", str(len(body)).encode(), b"\r\n"]
    for k, v in headers:
        head += [k, b": ", v, b"\r\n"]
    head.append(b"\r\n")
    assert stream.transport is not None
    try:
        stream.transport.write(b"".join(head))
        stream.transport.write(body)
    except (OSError, RuntimeError) as exc:  # the server reset the connection as it was opened
        stream.close()
        raise UpstreamUnavailable(f"{pool.address}: the connection failed while sending ({exc})") from exc
    return stream
