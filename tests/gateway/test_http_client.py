"""The upstream HTTP client against a real socket server that answers as a misbehaving or
interim-answering HTTP/1.1 server would: every request reads its own final answer, or none."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gateway.errors import UpstreamTimeout
from gateway.upstream.http_client import HttpPool


def _answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


async def _serve(
    reply: Callable[[int], bytes],
    then: Callable[[int, asyncio.StreamWriter], Awaitable[None]] | None = None,
    before: Callable[[int], Awaitable[None]] | None = None,
) -> tuple[asyncio.Server, str, list[int]]:
    """A server that answers its n-th request (over all connections) with `reply(n)`, then runs
    `then(n, writer)` (what a misbehaving server sends next); `before(n)` holds the answer back."""
    count = [0]
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                count[0] += 1
                if before is not None:
                    await before(count[0])
                writer.write(reply(count[0]))
                await writer.drain()
                if then is not None:
                    await then(count[0], writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"127.0.0.1:{port}", connections


def test_interim_answers_are_skipped_and_the_final_one_is_the_requests() -> None:
    async def main() -> list[tuple[int, bytes]]:
        server, address, _ = await _serve(
            lambda n: (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                + _answer(f"answer-{n}".encode())
            )
        )
        pool = HttpPool(address)
        try:
            got = []
            for _ in range(3):
                resp = await pool.request(b"POST", b"/x", b"{}", timeout_s=10)
                got.append((resp.status, resp.body))
            return got
        finally:
            await pool.close()
            server.close()

    assert asyncio.run(main()) == [(200, b"answer-1"), (200, b"answer-2"), (200, b"answer-3")]


def test_bytes_after_an_answer_never_become_the_next_requests_answer() -> None:
    """A server that sends two answers to one request (the second unasked for): the connection is
    dropped, and the next request gets its own answer on a new one."""

    async def main() -> tuple[list[bytes], int]:
        server, address, connections = await _serve(
            lambda n: (
                _answer(f"answer-{n}".encode()) + _answer(b"stray")
                if n == 1
                else _answer(f"answer-{n}".encode())
            )
        )
        pool = HttpPool(address)
        try:
            bodies = [(await pool.request(b"POST", b"/x", b"{}", timeout_s=10)).body for _ in range(3)]
            return bodies, len(connections)
        finally:
            await pool.close()
            server.close()

    bodies, connections = asyncio.run(main())
    assert bodies == [b"answer-1", b"answer-2", b"answer-3"]
    assert connections == 2  # the first connection, out of step after the stray answer, was not reused


def test_an_answer_arriving_while_the_connection_is_idle_closes_it() -> None:
    async def main() -> tuple[list[bytes], int]:
        stray = asyncio.Event()

        async def stray_after_first(n: int, writer: asyncio.StreamWriter) -> None:
            if n == 1:
                await stray.wait()
                writer.write(_answer(b"stray"))
                await writer.drain()

        server, address, connections = await _serve(
            lambda n: _answer(f"answer-{n}".encode()), stray_after_first
        )
        pool = HttpPool(address)
        try:
            first = await pool.request(b"POST", b"/x", b"{}", timeout_s=10)
            idle = pool._idle[-1]
            stray.set()
            async with asyncio.timeout(30):  # a bound, not a duration under test
                while not idle.closed:  # the stray answer arrives on the idle connection
                    await asyncio.sleep(0.01)
            second = await pool.request(b"POST", b"/x", b"{}", timeout_s=10)
            return [first.body, second.body], len(connections)
        finally:
            await pool.close()
            server.close()

    assert asyncio.run(main()) == ([b"answer-1", b"answer-2"], 2)  # the second on a new connection


async def _serve_held(held: int) -> tuple[asyncio.Server, str, asyncio.Event]:
    """A server that answers each request at once, the `held`-th once the returned event is set."""
    release = asyncio.Event()

    async def hold(n: int) -> None:
        if n == held:
            await release.wait()

    server, address, _ = await _serve(lambda n: _answer(f"answer-{n}".encode()), before=hold)
    return server, address, release


def test_a_shorter_bound_after_a_longer_one_on_the_same_connection_still_expires() -> None:
    """The connection keeps one timer across its requests: a request bounded more tightly than the
    one before it must not wait for the earlier, later deadline."""

    async def main() -> tuple[bytes, str, int]:
        server, address, release = await _serve_held(2)
        pool = HttpPool(address)
        try:
            first = await pool.request(b"POST", b"/x", b"{}", timeout_s=300)
            async with asyncio.timeout(60):  # a bound on the test, far above the request's own
                try:
                    await pool.request(b"POST", b"/x", b"{}", timeout_s=0.2)
                except UpstreamTimeout as exc:
                    refused = str(exc)
            return first.body, refused, len(pool._idle)
        finally:
            release.set()
            await pool.close()
            server.close()

    body, refused, idle = asyncio.run(main())
    assert body == b"answer-1" and "no response within 0.200s" in refused
    assert idle == 0  # the expired request's connection is closed, not pooled


def test_an_earlier_requests_deadline_never_expires_a_later_request() -> None:
    """The timer armed for the first request fires during the second, which has a later deadline of
    its own: it re-arms for the second's deadline, and the second gets its answer."""

    async def main() -> list[bytes]:
        server, address, release = await _serve_held(2)
        pool = HttpPool(address)
        try:
            first = await pool.request(b"POST", b"/x", b"{}", timeout_s=0.2)
            conn = pool._idle[-1]
            fired_at = conn.timer.handle_at
            second = asyncio.ensure_future(pool.request(b"POST", b"/x", b"{}", timeout_s=300))
            async with asyncio.timeout(60):
                while conn.timer.handle_at == fired_at:  # the first deadline has passed: re-armed
                    await asyncio.sleep(0.01)
            release.set()
            return [first.body, (await second).body]
        finally:
            await pool.close()
            server.close()

    assert asyncio.run(main()) == [b"answer-1", b"answer-2"]
