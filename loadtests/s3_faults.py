"""An S3 proxy that fails a share of storage calls the way S3 does: the store under fault tests and
`make chaos`, in front of a real S3-compatible server (moto's server mode).

It reads HTTP/1.1 exchanges one at a time (path-style S3: what boto3 sends with
`addressing_style=path`) and forwards them; a call drawn to fail (`FaultPlan.fraction`) gets one of
the enabled kinds that applies to it:

- `503`: S3's throttling answer, `503 SlowDown` with its XML error body (S3 API reference, "Error
  responses"); the call never reaches the store;
- `timeout`: no answer at all; the connection is held for `hang_s`, then closed (the call never
  reaches the store: a client's read timeout decides what it sees);
- `empty_listing`: a ListObjects answer with every key and common prefix removed (`KeyCount` 0,
  not truncated): a store, a permission or a bucket that looks empty;
- `partial_listing`: a ListObjects answer missing a random half of its keys and common prefixes,
  and still saying it is complete;
- `slow`: the store's answer, its body trickled out over `slow_s`.

With `on_stored`, every write the store accepted is reported before the client hears of it (the
chaos run keeps Triton's copy of the bucket current with it). The plan is changed while the proxy runs (`proxy.plan = FaultPlan(...)`) by whoever started it;
`proxy.counts` says how many calls went through and how many failed, by kind.
`python -m loadtests.s3_faults LISTEN_PORT UPSTREAM_PORT [--fraction F] [--kinds 503,timeout,...]`
runs one in the foreground.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

KINDS = ("503", "timeout", "empty_listing", "partial_listing", "slow")
LISTING_KINDS = {"empty_listing", "partial_listing"}
# A GET on a bucket with only these parameters is a ListObjects(V2) call; others (?location,
# ?versioning, ?uploads...) are other bucket operations.
LISTING_PARAMS = {
    "list-type", "prefix", "delimiter", "continuation-token", "start-after", "max-keys",
    "encoding-type", "fetch-owner", "marker",
}  # fmt: skip
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>"
)
_ENTRY = re.compile(rb"<(Contents|CommonPrefixes)>.*?</\1>", re.S)


@dataclass(frozen=True)
class FaultPlan:
    """Which share of calls fail, how, and for how long the slow kinds take."""

    fraction: float = 0.0
    kinds: tuple[str, ...] = KINDS
    hang_s: float = 30.0  # a `timeout` call's connection is held this long, then closed
    slow_s: float = 2.0  # a `slow` answer's body takes this long to arrive

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fault fraction must be within [0, 1], got {self.fraction}")
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise ValueError(f"fault kinds must be some of {', '.join(KINDS)}, got {list(self.kinds)}")
        if self.hang_s <= 0 or self.slow_s <= 0:
            raise ValueError(f"hang_s and slow_s must be positive, got {self.hang_s} and {self.slow_s}")


@dataclass
class Exchange:
    """One HTTP/1.1 message: its start line, headers (in order) and the whole body."""

    start: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def encode(self) -> bytes:
        """The message with its whole body, sent with a Content-Length when it had a body or a
        length (a chunked body is re-sent whole; a body rewritten here gets its new length)."""
        framing = {b"content-length", b"transfer-encoding", b"expect"}
        lines = [self.start] + [k + b": " + v for k, v in self.headers if k.lower() not in framing]
        if self.body or self.header(b"content-length") is not None or self.header(b"transfer-encoding"):
            lines.append(b"Content-Length: " + str(len(self.body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body


@dataclass
class _Request:
    message: Exchange
    method: str
    listing: bool  # a ListObjects(V2) call: GET on a bucket, no key


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip(), value.strip()))
    return lines[0], headers


async def _read_body(reader: asyncio.StreamReader, msg: Exchange, until_eof: bool) -> None:
    if (msg.header(b"transfer-encoding") or b"").lower() == b"chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers are sent by boto3 or moto
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        msg.body = b"".join(parts)
    elif (length := msg.header(b"content-length")) is not None:
        msg.body = await reader.readexactly(int(length)) if int(length) else b""
    elif until_eof:
        msg.body = await reader.read()


def _drop_entries(body: bytes, keep: float, rng: random.Random) -> bytes:
    """A listing without (1 - keep) of its entries, its KeyCount matching what is left."""
    kept = 0

    def choose(match: re.Match[bytes]) -> bytes:
        nonlocal kept
        if rng.random() < keep:
            kept += 1
            return match.group(0)
        return b""

    body = _ENTRY.sub(choose, body)
    body = re.sub(rb"<KeyCount>\d+</KeyCount>", b"<KeyCount>%d</KeyCount>" % kept, body)
    return re.sub(rb"<IsTruncated>true</IsTruncated>", b"<IsTruncated>false</IsTruncated>", body)


@dataclass
class S3FaultProxy:
    """The proxy on 127.0.0.1:`port` (0: a free one) in front of `upstream` (host, port), run on its
    own event loop in a daemon thread by `start()`; `stop()` closes it and every connection."""

    upstream: tuple[str, int]
    plan: FaultPlan = field(default_factory=FaultPlan)
    port: int = 0
    seed: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    # Called (in a worker thread) with (method, path, body) for each PUT or DELETE the store accepted,
    # before the client hears of it: a view of the bucket that a client's next call must find current.
    on_stored: Callable[[str, str, bytes], None] | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-faults", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- one client connection -------------------------------------------------------------------
    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = await self._read_request(client_r, client_w)
                if request is None:
                    return
                self.counts["requests"] += 1
                kind = self._draw(request)
                if kind is not None:
                    self.counts[kind] += 1
                if kind == "503":
                    client_w.write(_slow_down())
                    await client_w.drain()
                    continue
                if kind == "timeout":
                    await asyncio.sleep(self.plan.hang_s)
                    return
                upstream, response = await self._forward(upstream, request)
                stored = response.start.split(b" ")[1:2] in ([b"200"], [b"204"])
                if self.on_stored is not None and stored and request.method in ("PUT", "DELETE"):
                    path = urlsplit(request.message.start.split(b" ")[1].decode()).path
                    await asyncio.to_thread(self.on_stored, request.method, path, request.message.body)
                if kind in LISTING_KINDS and response.start.split(b" ")[1:2] == [b"200"]:
                    keep = 0.0 if kind == "empty_listing" else 0.5
                    response.body = _drop_entries(response.body, keep, self._rng)
                await self._send(client_w, response, request.method, slow=kind == "slow")
                if (response.header(b"connection") or b"").lower() == b"close":
                    return  # the store ends the connection after this answer: so does the proxy
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            client_w.close()
            if upstream is not None:
                upstream[1].close()

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Request | None:
        try:
            start, headers = await _read_head(reader)
        except asyncio.IncompleteReadError:
            return None  # the client closed between requests
        msg = Exchange(start, headers)
        if (msg.header(b"expect") or b"").lower() == b"100-continue":
            # Answered here, the body read whole: the request then goes upstream as one message.
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        await _read_body(reader, msg, until_eof=False)
        method, target = start.split(b" ")[:2]
        url = urlsplit(target.decode())
        bucket_only = bool(url.path.strip("/")) and "/" not in url.path.strip("/")
        params = set(parse_qs(url.query, keep_blank_values=True))
        listing = method == b"GET" and bucket_only and params <= LISTING_PARAMS
        return _Request(msg, method.decode(), listing)

    async def _read_response(self, reader: asyncio.StreamReader, method: str) -> Exchange:
        start, headers = await _read_head(reader)
        msg = Exchange(start, headers)
        status = int(start.split(b" ")[1])
        if method != "HEAD" and status not in (204, 304) and status >= 200:
            closes = (msg.header(b"connection") or b"").lower() == b"close"
            await _read_body(reader, msg, until_eof=closes)
        return msg

    async def _forward(
        self, upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, request: _Request
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, Exchange]:
        """The store's answer, over the kept connection or a new one (a kept connection the store
        closed meanwhile is replaced once: that is no fault of the plan's); the connection to keep."""
        for attempt in range(2):
            reused = upstream is not None
            if upstream is None:
                upstream = await asyncio.open_connection(*self.upstream)
            up_r, up_w = upstream
            try:
                up_w.write(request.message.encode())
                await up_w.drain()
                response = await self._read_response(up_r, request.method)
            except (asyncio.IncompleteReadError, ConnectionError):
                up_w.close()
                upstream = None
                if reused and attempt == 0:
                    continue
                raise
            if (response.header(b"connection") or b"").lower() == b"close":
                up_w.close()
                upstream = None
            return upstream, response
        raise AssertionError("unreachable")

    async def _send(self, writer: asyncio.StreamWriter, response: Exchange, method: str, slow: bool) -> None:
        data = response.encode() if method != "HEAD" else _head_answer(response)
        if not slow:
            writer.write(data)
            await writer.drain()
            return
        head_len = len(data) - len(response.body)
        writer.write(data[:head_len])
        await writer.drain()
        pieces = 10
        step = max(1, -(-len(response.body) // pieces))
        for i in range(0, max(len(response.body), 1), step):
            await asyncio.sleep(self.plan.slow_s / pieces)
            writer.write(response.body[i : i + step])
            await writer.drain()

    def _draw(self, request: _Request) -> str | None:
        plan = self.plan
        if plan.fraction <= 0 or self._rng.random() >= plan.fraction:
            return None
        kinds = [k for k in plan.kinds if request.listing or k not in LISTING_KINDS]
        return self._rng.choice(kinds) if kinds else None


def _slow_down() -> bytes:
    return (
        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
        + str(len(SLOW_DOWN)).encode()
        + b"\r\n\r\n"
        + SLOW_DOWN
    )


def _head_answer(response: Exchange) -> bytes:
    """A HEAD answer as received: its Content-Length is the object's, and no body follows."""
    lines = [response.start] + [k + b": " + v for k, v in response.headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("listen_port", type=int)
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--hang-s", type=float, default=30.0)
    parser.add_argument("--slow-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plan = FaultPlan(args.fraction, tuple(args.kinds.split(",")), args.hang_s, args.slow_s)
    proxy = S3FaultProxy(("127.0.0.1", args.upstream_port), plan, args.listen_port, args.seed).start()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        proxy.stop()


if __name__ == "__main__":
    main()
