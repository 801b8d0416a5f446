"""The HTTP protocol's own cost per infer request, in-process, side by side with its references.

Each protocol is fed the same keep-alive HTTP/1.1 JSON infer request through `data_received` (a
transport that records writes instead of a socket, so no syscall and no load generator is in the
figure) and answers it with the same small JSON body; one request at a time, as a connection
carries them. What is measured is everything between the request's bytes and the answer's bytes
that is not the pipeline: parsing callbacks, per-request state, timers, the task, the answer's head.

- the gateway's protocol (gateway/fronts/http_protocol.py: infer served from the protocol, one
  timer per connection), with an app whose `infer` writes the answer at once;
- the same protocol with a task per request, as it was before eager start (the request runs from the
  callback that completed it: gateway/fronts/eager_start.py);
- uvicorn's httptools protocol with an ASGI app doing the same (what an ASGI route pays: scope,
  receive/send messages, the keep-alive timer per response);
- a minimal httptools protocol (parse, one task, one write): the floor any Python protocol pays.

Usage: python benchmarks/http_protocol_bench.py [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools
import uvicorn
import uvloop
from uvicorn.server import ServerState

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.fronts.http_protocol import ConnectionBounds, HeaderTimeoutProtocol, with_header_timeout  # noqa: E402

BODY = b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1.0,2.0,3.0,4.0]}]}'
REQUEST = (
    b"POST /v2/models/bench/infer HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
ANSWER = b'{"model_name":"bench","model_version":"1","outputs":[]}'
JSON = [(b"content-type", b"application/json")]


class RecordingTransport(asyncio.Transport):
    """A connection's transport without the socket: each write resolves the waiting request."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: asyncio.Future[None] | None = None
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.answered is not None and not self.answered.done() and bytes(data).endswith(ANSWER):
            self.answered.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


class InferApp:
    """The gateway's app shape: `infer` for the protocol's own path (the ASGI entry is not used)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("an infer request reached the ASGI entry")

    async def infer(self, exchange: Any, headers: Any, *target: Any) -> None:
        if exchange.whole_body() is None:
            while (await exchange.receive_chunk() or (b"", False))[1]:
                pass
        await exchange.write(200, JSON, ANSWER)


async def asgi_app(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI route that reads the body and answers the same bytes."""
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*JSON, (b"content-length", b"%d" % len(ANSWER))],
        }
    )
    await send({"type": "http.response.body", "body": ANSWER})


class MinimalProtocol(asyncio.Protocol):
    """Parse with httptools, run one task per request, answer in one write."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.headers, self.body = [], b""

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        asyncio.get_running_loop().create_task(self.answer())

    async def answer(self) -> None:
        head = [b"HTTP/1.1 200 OK\r\n"]
        for name, value in JSON:
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-length: %d\r\n\r\n" % len(ANSWER))
        self.transport.write(b"".join(head) + ANSWER)


def uvicorn_protocol(app: Any, http: Any) -> asyncio.Protocol:
    """`http`'s protocol as the gateway's listeners configure uvicorn (gateway/fronts/http_protocol.py)."""
    config = uvicorn.Config(
        app,
        http=http,
        loop="none",
        lifespan="off",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        log_config=None,
        timeout_keep_alive=15,
    )
    config.load()
    return config.http_protocol_class(config=config, server_state=ServerState(), app_state={})  # type: ignore[no-any-return]


async def per_request_us(make: Callable[[], asyncio.Protocol], requests: int) -> float:
    """Wall µs per request of one connection carrying `requests` requests one after another (the
    process does nothing else, so wall time is the protocol's CPU)."""
    protocol = make()
    transport = RecordingTransport()
    protocol.connection_made(transport)
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    for _ in range(requests):
        transport.answered = loop.create_future()
        protocol.data_received(REQUEST)
        await transport.answered
    elapsed = time.perf_counter() - start
    protocol.connection_lost(None)
    return elapsed / requests * 1e6


def tasked_protocol() -> Callable[..., Any]:
    """The gateway's protocol as it was before eager start: a task for every infer request."""

    class Tasked(HeaderTimeoutProtocol):
        def _start_eagerly(self, cycle: Any) -> None:
            self._start_asgi_task(cycle, self.app)

    return functools.partial(Tasked, bounds=ConnectionBounds(10.0))


PROTOCOLS: dict[str, Callable[[], asyncio.Protocol]] = {
    "skewserve gateway (infer served from the protocol)": lambda: uvicorn_protocol(
        InferApp(), with_header_timeout(10.0)
    ),
    "skewserve gateway, a task per request (before eager start)": lambda: uvicorn_protocol(
        InferApp(), tasked_protocol()
    ),
    "uvicorn httptools + ASGI app": lambda: uvicorn_protocol(asgi_app, "httptools"),
    "minimal httptools protocol": MinimalProtocol,
}


async def measure(requests: int, rounds: int) -> dict[str, float]:
    """Median over `rounds` of each protocol's µs per request, the protocols interleaved."""
    runs: dict[str, list[float]] = {name: [] for name in PROTOCOLS}
    for make in PROTOCOLS.values():  # warm-up: imports, caches
        await per_request_us(make, 200)
    for _ in range(rounds):
        for name, make in PROTOCOLS.items():
            runs[name].append(await per_request_us(make, requests))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20000, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per protocol (median)")
    args = parser.parse_args()
    build = os.environ.get("SKEWSERVE_GATEWAY_BUILD", "compiled")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; gateway build asked for: {build} (the protocol itself is interpreted)\n"
    )
    print_table(uvloop.run(measure(args.requests, args.rounds)))


def print_table(figures: dict[str, float]) -> None:
    """`measure`'s figures as a markdown table, each as a ratio to the minimal protocol."""
    floor = figures["minimal httptools protocol"]
    print("| protocol | µs per infer request | / minimal |")
    print("|---|---:|---:|")
    for name, us in figures.items():
        print(f"| {name} | {us:.1f} | {us / floor:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
