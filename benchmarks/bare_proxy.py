"""A bare Python HTTP/1.1 pass-through: the floor a Python gateway's HTTP hop is measured against.

uvloop + httptools, one upstream connection per client connection: each request is parsed (method,
path, headers, body), written to the upstream whole, and the upstream's response is parsed and
written back whole. No auth, no limits, no routing, no metrics: what any Python proxy must pay for
parsing and moving bytes, and nothing else. Used by benchmarks/gateway_bench.py (section hop).
Usage: python benchmarks/bare_proxy.py LISTEN_PORT UPSTREAM_HOST:PORT
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[bytes] | None = None
        self.head: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in (b"content-length", b"transfer-encoding", b"connection"):
            self.head.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        status = self.parser.get_status_code()
        response = b"HTTP/1.1 %d OK\r\n%scontent-length: %d\r\n\r\n%s" % (
            status,
            b"".join(self.head),
            len(body),
            body,
        )
        self.head, self.body = [], []
        if self.waiter is not None:
            self.waiter.set_result(response)


class Client(asyncio.Protocol):
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream_address = upstream
        self.parser = httptools.HttpRequestParser(self)
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.url = b""
        self.head: list[bytes] = []
        self.body: list[bytes] = []
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.task = asyncio.get_running_loop().create_task(self.pump())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in (b"content-length", b"transfer-encoding", b"connection", b"host"):
            self.head.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        method = self.parser.get_method()
        request = b"%s %s HTTP/1.1\r\nhost: upstream\r\n%scontent-length: %d\r\n\r\n%s" % (
            method,
            self.url,
            b"".join(self.head),
            len(body),
            body,
        )
        self.url, self.head, self.body = b"", [], []
        self.queue.put_nowait(request)

    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(Upstream, *self.upstream_address)
        while True:
            request = await self.queue.get()
            upstream.waiter = loop.create_future()
            assert upstream.transport is not None
            upstream.transport.write(request)
            self.transport.write(await upstream.waiter)  # type: ignore[attr-defined]


async def main(port: int, upstream: str) -> None:
    host, _, up_port = upstream.rpartition(":")
    server = await asyncio.get_running_loop().create_server(
        lambda: Client((host, int(up_port))), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), sys.argv[2]))
