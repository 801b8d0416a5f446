"""An infer request whose body is in runs from the protocol's callback (gateway/fronts/eager_start.py):
no task unless it waits, and when it waits its task carries it on exactly as a task from the start
would (the result, a cancellation where it waits, its own context). Then on a real gateway: requests
pipelined in one write, a cached and an uncached one, and one that closes the connection, are each
answered in order; a body arriving in pieces is still read as it streams."""

from __future__ import annotations

import asyncio
import contextvars
import json
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from gateway.fronts.eager_start import start_eagerly
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway

REQUEST_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("request_var", default="unset")


def test_a_coroutine_that_never_waits_finishes_in_the_call_without_a_task() -> None:
    async def main() -> None:
        done: list[str] = []

        async def answer() -> None:
            REQUEST_VAR.set("mine")
            done.append(REQUEST_VAR.get())

        tasks_before = len(asyncio.all_tasks())
        assert start_eagerly(asyncio.get_running_loop(), answer()) is None
        assert done == ["mine"] and len(asyncio.all_tasks()) == tasks_before
        assert REQUEST_VAR.get() == "unset"  # its context was its own

    asyncio.run(main())


def test_a_coroutine_that_waits_is_carried_on_by_a_task_in_its_own_context() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        upstream: asyncio.Future[str] = loop.create_future()
        seen: list[str] = []

        async def answer() -> None:
            REQUEST_VAR.set("mine")
            seen.append("before")
            seen.append(await upstream)
            await asyncio.sleep(0)  # a bare yield too
            seen.append(REQUEST_VAR.get())

        task = start_eagerly(loop, answer())
        assert task is not None and seen == ["before"]  # it ran up to its wait in the call
        upstream.set_result("answer")
        await task
        assert seen == ["before", "answer", "mine"] and REQUEST_VAR.get() == "unset"

    asyncio.run(main())


def test_cancelling_the_task_reaches_the_coroutine_where_it_waits() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        upstream: asyncio.Future[str] = loop.create_future()
        cleaned: list[str] = []

        async def answer() -> None:
            try:
                await upstream
            except asyncio.CancelledError:
                cleaned.append("cancelled at its wait")
                raise

        task = start_eagerly(loop, answer())
        assert task is not None
        await asyncio.sleep(0)  # the task now waits on the same future
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == ["cancelled at its wait"] and upstream.cancelled()

    asyncio.run(main())


# -- a real gateway --------------------------------------------------------------------------------

ROW = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
BODY = json.dumps(
    {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": ROW.ravel().tolist()}]}
).encode()


def _request(model: str, extra: str = "", body: bytes = BODY) -> bytes:
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def _answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """`count` responses read off one connection (each with a content-length)."""
    buf, out = b"", []
    while len(out) < count:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            head = buf[:head_end].decode("latin-1").split("\r\n")
            length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
            if len(buf) >= head_end + 4 + length:
                out.append((int(head[0].split()[1]), buf[head_end + 4 : head_end + 4 + length]))
                buf = buf[head_end + 4 + length :]
                continue
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return out


@pytest.fixture(scope="module")
def gw(
    one_triton: dict[str, list[TritonServer]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayUnderTest]:
    g = launch_gateway(gateway_config(one_triton), tmp_path_factory.mktemp("eager_gw"))
    yield g
    g.stop()


def _connect(gw: GatewayUnderTest) -> socket.socket:
    host, port = gw.http.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def test_pipelined_cached_uncached_and_refused_requests_are_answered_in_order(gw: GatewayUnderTest) -> None:
    with _connect(gw) as warm:  # `lt` is cached (gateway_config): this puts the answer there
        warm.sendall(_request("lt"))
        assert _answers(warm, 1)[0][0] == 200
    bad = b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": "x"}]}'
    with _connect(gw) as sock:
        sock.sendall(_request("lt") + _request("lt_nocache") + _request("lt", body=bad) + _request("lt"))
        answers = _answers(sock, 4)
    assert [status for status, _ in answers] == [200, 200, 400, 200]
    outputs = [json.loads(body)["outputs"] for status, body in answers if status == 200]
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_request_after_one_that_closes_the_connection_is_not_run(gw: GatewayUnderTest) -> None:
    with _connect(gw) as sock:
        sock.sendall(_request("lt", "Connection: close\r\n") + _request("lt"))
        answers = _answers(sock, 2)
    assert [status for status, _ in answers] == [200]


def test_a_body_sent_after_the_headers_is_read_as_it_streams(gw: GatewayUnderTest) -> None:
    """The headers alone in one read: the request gets a task at once, which asks for the body
    (the interim 100 Continue says so); the body then arrives in a later read and is answered."""
    request = _request("lt_nocache", "Expect: 100-continue\r\n")
    head_end = request.index(b"\r\n\r\n") + 4
    with _connect(gw) as sock:
        sock.sendall(request[:head_end])
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(1)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(request[head_end:])
        [(status, body)] = _answers(sock, 1)
    assert status == 200 and json.loads(body)["outputs"]
