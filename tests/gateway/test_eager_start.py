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


@pytest.mark.parametrize("stepped", [True, False], ids=["while-it-waits", "before-its-first-step"])
def test_cancelling_the_task_reaches_the_coroutine_where_it_waits(stepped: bool) -> None:
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
        if stepped:
            await asyncio.sleep(0)  # the task now waits on the same future
        task.cancel()  # else in the same turn: the task has not stepped yet
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == ["cancelled at its wait"]
        assert upstream.cancelled() == stepped  # a task cancels the future it waits on

    asyncio.run(main())


# -- the protocol, in-process (a transport that records writes) -------------------------------------


class _Recorded(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def answers(self) -> list[bytes]:
        """Each response's body, in the order written (head and body may share a write)."""
        stream = b"".join(self.written)
        return [part.split(b"\r\n\r\n", 1)[1][:6] for part in stream.split(b"HTTP/1.1 ")[1:]]


class _App:
    """Infer answers at once with the model's name; a GET (the ASGI app) waits on `release`."""

    def __init__(self, release: asyncio.Future[None]) -> None:
        self.release = release

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        await self.release
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"6")]})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"GET-ok"})  # type: ignore[operator]

    async def infer(self, exchange: object, headers: object, model: str, *rest: object) -> None:
        await exchange.write(200, [], model.encode().ljust(6, b"."))  # type: ignore[attr-defined]


def _protocol(app: object, transport: _Recorded) -> asyncio.Protocol:
    import uvicorn
    from uvicorn.server import ServerState

    from gateway.fronts.http_protocol import with_header_timeout

    config = uvicorn.Config(
        app,
        http=with_header_timeout(10.0),
        loop="none",
        lifespan="off",
        access_log=False,
        proxy_headers=False,
        log_config=None,
    )
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(transport)
    return protocol  # type: ignore[no-any-return]


def _infer(model: str) -> bytes:
    return f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{{}}".encode()


def test_one_pipelined_read_runs_one_request_eagerly_and_the_rest_in_turn() -> None:
    async def main() -> None:
        transport = _Recorded()
        protocol = _protocol(_App(asyncio.get_running_loop().create_future()), transport)
        protocol.data_received(_infer("one") + _infer("two") + _infer("three"))
        assert transport.answers() == [b"one..."]  # answered in the callback; the others wait their turn
        for _ in range(20):
            await asyncio.sleep(0)
        assert transport.answers() == [b"one...", b"two...", b"three."]
        protocol.connection_lost(None)

    asyncio.run(main())


def test_an_answer_held_for_the_end_of_the_turn_goes_out_before_the_next_requests() -> None:
    """A GET's answer (ASGI, held to be joined with others of its loop turn) and an infer request
    read in that same turn: the infer answer, written at once, must not overtake it."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        release: asyncio.Future[None] = loop.create_future()
        transport = _Recorded()
        protocol = _protocol(_App(release), transport)
        protocol.data_received(b"GET /v2/models/m HTTP/1.1\r\nHost: gw\r\n\r\n")
        await asyncio.sleep(0)  # the GET's task now waits on `release`
        release.set_result(None)
        loop.call_soon(protocol.data_received, _infer("after"))  # queued after the GET's wake-up
        for _ in range(20):
            await asyncio.sleep(0)
        assert transport.answers() == [b"GET-ok", b"after."]
        protocol.connection_lost(None)

    asyncio.run(main())


class _HeaderApp:
    """Infer answers with one header of the value given (an upstream's, as the exchange sees it)."""

    def __init__(self, value: bytes) -> None:
        self.value = value

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        raise AssertionError("an infer request never reaches the ASGI app")

    async def infer(self, exchange: object, headers: object, model: str, *rest: object) -> None:
        answer = [(b"content-type", b"text/plain"), (b"x-answer", self.value)]
        await exchange.write(200, answer, b"answer")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "value,written",
    [
        (b"a\tb", True),
        (b"a\r\nset-cookie: x", False),
        (b"a\nb", False),
        (b"a\x00b", False),
        (b"a\x7fb", False),
    ],
    ids=["tab", "crlf", "lf", "nul", "del"],
)
def test_an_answer_header_with_a_control_character_is_never_written(value: bytes, written: bool) -> None:
    """The exchange checks every answer header's value before its one write: a tab is a value's
    own, any other control character would split or corrupt the response, so none of that answer
    is written and the connection closes (the 500 then written to the closed transport is dropped
    by a real one; this recording transport keeps it)."""

    async def main() -> None:
        transport = _Recorded()
        protocol = _protocol(_HeaderApp(value), transport)
        protocol.data_received(_infer("m"))
        for _ in range(5):
            await asyncio.sleep(0)
        sent = b"".join(transport.written)
        assert (b"x-answer: " + value + b"\r\n" in sent) == written
        assert (b"x-answer" in sent) == written
        assert transport.closing != written
        assert (b"200 OK" in sent) == written
        protocol.connection_lost(None)

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
