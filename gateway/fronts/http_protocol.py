"""uvicorn's httptools protocol with a bound on receiving request headers, one write per response,
and the infer path served from the protocol itself.

Infer requests (`POST /v2/models/{m}[/versions/{v}]/infer`) skip ASGI: once their headers are in,
an `InferExchange` (gateway/fronts/infer_exchange.py) takes uvicorn's place for the request (same flow control, keep-alive and
pipelining) and hands its bytes straight to the pipeline (gateway/fronts/http_front.py `infer`);
the answer goes out in one write. A request whose body is complete is run from the callback that
completed it (gateway/fronts/eager_start.py): one answered without waiting on the network (a cache
hit, a refusal) is written before that callback returns, with no task. Every other request goes to the ASGI app (FastAPI) on the same
connection. The connection owns what uvicorn builds per request: no ASGI scope is built unless the
request goes to the ASGI app, the exchange keeps only the state the protocol reads, and the header
and keep-alive bounds share one timer per connection (gateway/connection_timer.py) instead
of a timer started and cancelled per request for each (benchmarks/http_protocol_bench.py).

uvicorn times out idle keep-alive connections but not a request whose headers never finish: a
client that sends half a request line and waits holds its socket (and a file descriptor) forever,
and a few thousand such clients exhaust the gateway (slowloris). Here a timer runs while a
connection waits for a request's headers (from connect, and from a new request's first byte) and
closes the connection when they are not complete within `limits.header_read_timeout_s`.

uvicorn writes a response's head and its body with a send() each; on loopback a send costs about
as much as the rest of a cache hit. `_OneWrite` holds small writes made in the same event-loop
turn and sends them together at the end of it.

The protocol is compiled (gateway/compiled_build.py): the parser's callbacks run for every request,
and interpreted they cost about 7,000 of a cache hit's 144,000 instructions (docs/benchmarks.md,
"The connection compiled"). uvicorn's class stays its base (the
ASGI path, upgrades and errors are its code), so what compiled code reads of uvicorn's attributes
is read as uvicorn sets it, not as its annotations say (`timeout_keep_alive` is a float here).
A listener's bounds are an object given to each connection (`ConnectionBounds`), not class
attributes: a compiled class's attributes are its instances'.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, Final

import httptools
import uvicorn
from mypy_extensions import mypyc_attr
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.config import GatewayConfig
from gateway.connection_timer import ConnectionTimer
from gateway.fronts.eager_start import start_eagerly
from gateway.fronts.infer_exchange import COALESCE_BYTES, InferExchange, infer_target
from gateway.state.limits import client_key

logger: Final = logging.getLogger(__name__)


class _OneWrite:
    """The connection's transport as a request cycle sees it: small writes of one loop turn are
    sent as one (flushed at the end of the turn, and before close)."""

    __slots__ = ("transport", "loop", "pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.loop = loop
        self.pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self.pending is None:
            if len(data) >= COALESCE_BYTES:
                self.transport.write(data)
                return
            self.pending = [data]
            self.loop.call_soon(self.flush)
            return
        if len(data) >= COALESCE_BYTES:
            self.flush()
            self.transport.write(data)
            return
        self.pending.append(data)

    def flush(self) -> None:
        pending, self.pending = self.pending, None
        if pending and not self.transport.is_closing():
            self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self.transport, name)


# What a connection's one timer (gateway/connection_timer.py) is waiting for.
_WAIT_HEADERS: Final = 1
_WAIT_KEEP_ALIVE: Final = 2


class ConnectionBounds:
    """One listener's bounds on its connections: `header_timeout_s` for a request's headers, at most
    `max_per_source` open connections per client address (0: any number), counted in `sources`."""

    __slots__ = ("header_timeout_s", "max_per_source", "sources")

    def __init__(self, header_timeout_s: float, max_per_source: int = 0) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_per_source = max_per_source
        # open connections by client key
        self.sources: dict[str, set[HeaderTimeoutProtocol]] = {}


# Interpreted subclasses: benchmarks/http_protocol_bench.py measures a variant.
@mypyc_attr(allow_interpreted_subclasses=True)
class HeaderTimeoutProtocol(HttpToolsProtocol):
    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        bounds: ConnectionBounds,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # Native copies of what uvicorn sets once per connection and every request reads: read from
        # the interpreted base, each is a generic attribute lookup (13 of them cost about 3,000
        # instructions a request). The transport and flow are copied in connection_made.
        self._parser: Any = self.parser
        self._app: Any = self.app
        self._tasks: set[asyncio.Task[None]] = self.tasks
        self._connections: set[Any] = self.connections
        self._limit_concurrency: int | None = self.limit_concurrency
        self._pipeline: Any = self.pipeline
        self._event_loop: asyncio.AbstractEventLoop = self.loop
        self._server_state: Any = self.server_state
        self._logger: Any = self.logger
        self._transport: Any = None
        self._flow: Any = None
        self._client_host = ""
        self.bounds = bounds
        self.header_timeout_s = self.bounds.header_timeout_s
        # Read untyped: uvicorn annotates an int, the gateway gives a float, compiled code checks.
        self.keep_alive_s = float(getattr(config, "timeout_keep_alive"))  # noqa: B009
        self._source: str | None = None  # counted in `bounds.sources` while open
        self.serves_infer = hasattr(self.app, "infer")
        # Both bounds (a request's headers, an idle keep-alive) on one timer: uvicorn starts and
        # cancels a timer per request for each.
        self._timer = ConnectionTimer(self.loop, self._expired)
        # An infer request whose headers are in, started once its body is (from the callback that
        # completes it, eagerly) or when the read that brought it ends (a task: the body streams).
        self._unstarted: InferExchange | None = None
        # At most one request per read runs eagerly: the rest of a pipelined read waits its turn as
        # before, so one client's pipelined cache hits cannot hold the loop for a whole read.
        self._ran_eagerly = False

    def _expired(self, wait: int) -> None:
        if self.transport.is_closing():
            return
        if wait == _WAIT_HEADERS:
            self._headers_too_slow()
        else:
            self.timeout_keep_alive_handler()

    def _arm_header_timer(self) -> None:
        if self._timer.wait != _WAIT_HEADERS:  # from connect, or from a new request's first byte
            self._timer.arm(_WAIT_HEADERS, self.header_timeout_s)

    def _disarm_header_timer(self) -> None:
        self._timer.disarm(_WAIT_HEADERS)

    def _unset_keepalive_if_required(self) -> None:
        self._timer.disarm(_WAIT_KEEP_ALIVE)

    def _headers_too_slow(self) -> None:
        if not self.transport.is_closing():
            logger.info(
                "closing a connection from %s: request headers not complete within %g s "
                "(limits.header_read_timeout_s)",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()

    # -- connections -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._transport, self._flow = self.transport, self.flow
        self._client_host = self.client[0] if self.client else ""
        if self.bounds.max_per_source and not self._admit_source():
            return
        self._arm_header_timer()  # a connection that sends nothing is bounded too

    def _admit_source(self) -> bool:
        """Count this connection against its client address; past the bound, 503 and close. At the
        listener's connection cap, make room: an idle connection of the address holding the most
        is closed, so a few dozen addresses flooding idle connections cannot lock newcomers out."""
        source = client_key(self.client[0]) if self.client else ""
        sources = self.bounds.sources
        mine = sources.setdefault(source, set())
        if len(mine) >= self.bounds.max_per_source:
            if not mine:
                sources.pop(source, None)
            body = (
                b'{"error":"this client address holds too many connections (limits.max_connections_per_source); '
                b'reuse kept-alive connections or close idle ones"}'
            )
            self.transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            self.transport.close()
            return False
        mine.add(self)
        self._source = source
        if self.limit_concurrency is not None and len(self.connections) >= self.limit_concurrency:
            self._make_room(len(mine))
        return True

    def _make_room(self, held: int) -> None:
        """Close one idle connection of the client address holding the most connections, if it
        holds more than this connection's address (`held`, this one included)."""
        largest = max(self.bounds.sources.values(), key=len, default=set())
        if len(largest) <= held:
            return  # this address is among the largest holders: it waits like everyone
        for other in largest:
            if other.idle():
                logger.info(
                    "at the connection cap (limits.max_connections): closing an idle connection of %s, "
                    "which holds %d, for a new client",
                    other.client[0] if other.client else "?",
                    len(largest),
                )
                other.connections.discard(other)  # counted out now: this connection's request may be next
                other.transport.close()
                return

    def idle(self) -> bool:
        """No request in flight or queued: closing loses nothing (an idle kept-alive connection)."""
        return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.close()
        if self._source is not None:
            sources = self.bounds.sources
            mine = sources.get(self._source)
            if mine is not None:
                mine.discard(self)
                if not mine:
                    sources.pop(self._source, None)  # the map holds open sources only
            self._source = None
        super().connection_lost(exc)

    # -- requests ----------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # uvicorn's per-request state without its ASGI scope: an infer request never reads one,
        # so it is built when the headers say the request goes to the ASGI app.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._arm_header_timer()  # a keep-alive connection's next request (already armed on connect)

    def on_url(self, url: bytes) -> None:  # uvicorn's, compiled
        self.url = self.url + url  # not +=: mypyc cannot augment an attribute its interpreted base declares

    def on_header(self, name: bytes, value: bytes) -> None:  # uvicorn's, compiled
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def _asgi_scope(self) -> None:
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers

    def shutdown(self) -> None:
        # uvicorn closes the socket of a finished response at once: send what this turn wrote first.
        writer = self.cycle.transport if self.cycle is not None else None
        if isinstance(writer, _OneWrite):
            writer.flush()
        super().shutdown()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        if self._parser.get_method() == b"POST" and self._start_infer():
            return
        self._asgi_scope()
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = _OneWrite(self._transport, self._event_loop)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        cycle: Any = self.cycle
        if not isinstance(cycle, InferExchange):  # narrowed, compiled code reads its fields natively
            super().on_body(body)
            return
        if cycle.response_complete:  # answered early (an error): the rest of the body is dropped
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self._flow.pause_reading()
        cycle.message_event.set()

    def data_received(self, data: bytes) -> None:
        self._ran_eagerly = False
        self._unset_keepalive_if_required()
        try:  # uvicorn's, compiled
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)  # closes the connection: nothing below starts
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        cycle = self._unstarted
        if cycle is not None:  # the body comes in later reads: the request reads it as it streams
            self._unstarted = None
            if not self._transport.is_closing():
                self._start_asgi_task(cycle, self._app)  # type: ignore[arg-type]

    def on_message_complete(self) -> None:
        cycle: Any = self.cycle
        if not isinstance(cycle, InferExchange):
            super().on_message_complete()
            return
        if not cycle.response_complete:
            cycle.more_body = False
            # The whole body is here: an interim 100 Continue is moot (RFC 9110 10.1.1: a server
            # may omit it once it has the content).
            cycle.waiting_for_100_continue = False
            cycle.message_event.set()
        if cycle is self._unstarted:
            self._unstarted = None
            # A request pipelined after one that closed the connection in this same read is not run
            # (uvicorn never starts a pipelined request once the connection is closing).
            if not self._transport.is_closing():
                self._start_eagerly(cycle)

    def _start_eagerly(self, cycle: InferExchange) -> None:
        """The whole request is in: run it here, in this callback, and only if it waits (for an
        upstream) does it get a task. A cache hit or a refusal is written before this returns."""
        self._ran_eagerly = True
        try:
            task = start_eagerly(self._event_loop, cycle.run_asgi(self._app))
        except Exception:  # run_asgi answers its own errors: this is a bug, never a parser error
            logger.exception("exception starting an infer request")
            self._transport.close()
            return
        if task is not None:
            task.add_done_callback(self._tasks.discard)
            self._tasks.add(task)

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive wait on the connection's one timer."""
        self._server_state.total_requests += 1
        if self._transport.is_closing():
            return
        self._unset_keepalive_if_required()
        flow = self._flow
        if flow.read_paused:  # read here: uvicorn's method is an interpreted call per request
            flow.resume_reading()
        if self._pipeline:
            cycle, app = self._pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._timer.wait != _WAIT_HEADERS:  # a next request's headers in progress keep their bound
            self._timer.arm(_WAIT_KEEP_ALIVE, self.keep_alive_s)

    def _start_infer(self) -> bool:
        """Serve an infer request from the protocol (True), or leave it to ASGI (False)."""
        if not self.serves_infer or (self._parser.should_upgrade() and self._should_upgrade()):
            return False
        if self._limit_concurrency is not None and (
            len(self._connections) >= self._limit_concurrency or len(self._tasks) >= self._limit_concurrency
        ):
            return False  # uvicorn's 503
        target = infer_target(self.url)
        if target is None:
            return False
        existing = self.cycle
        if existing is not None:
            # The answer before this one may still be held for the end of the loop turn (_OneWrite):
            # it goes out first, since this one may be written before that turn ends.
            writer = existing.transport
            if isinstance(writer, _OneWrite):
                writer.flush()
        keep_alive = self._parser.get_http_version() != "1.0" and self._parser.should_keep_alive()
        cycle = InferExchange(  # positional: a compiled class
            self._transport,
            self._flow,
            self._logger,
            self._server_state.default_headers,  # uvicorn renews it (the date) every second
            self.on_response_complete,
            self.expect_100_continue,
            keep_alive,
            target,
            self.headers,
            self._client_host,
        )
        self.cycle = cycle  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            if self._ran_eagerly:  # one eager start per read: this one gets a task (one turn later)
                self._start_asgi_task(cycle, self._app)  # type: ignore[arg-type]
            else:
                self._unstarted = cycle  # started by on_message_complete or at the end of this read
        else:  # pipelined: started when the one before it has answered
            self._flow.pause_reading()
            self._pipeline.appendleft((cycle, self._app))  # type: ignore[arg-type]
        return True


def with_header_timeout(timeout_s: float, max_per_source: int = 0) -> Callable[..., HeaderTimeoutProtocol]:
    """The protocol factory for one listener (uvicorn's `http`): connections whose headers take over
    `timeout_s` are closed, and one client address holds at most `max_per_source` connections
    (0: any number)."""
    return functools.partial(HeaderTimeoutProtocol, bounds=ConnectionBounds(timeout_s, max_per_source))


def per_worker_share(limit: int, workers: int) -> int:
    """A per-source bound split over worker processes (the kernel spreads a source's connections
    over them): each holds its share, rounded up; 0 stays 0 (off)."""
    return -(-limit // max(workers, 1)) if limit else 0


def uvicorn_config(app: Any, cfg: GatewayConfig, public: bool = False) -> uvicorn.Config:
    """Every gateway listener's uvicorn settings (public HTTP, a worker's ops socket, the ops port of
    a single process or of the supervisor): the header-read timer, the connection bound; and on
    the `public` listener, listen.tls."""
    tls = cfg.listen.tls if public else None
    return uvicorn.Config(
        app,
        ssl_certfile=tls.cert_file if tls is not None else None,
        ssl_keyfile=tls.key_file if tls is not None else None,
        loop="none",
        # httptools with a bound on receiving headers (uvicorn has none: slowloris); uvicorn calls
        # what it is given.
        http=with_header_timeout(  # type: ignore[arg-type]
            cfg.limits.header_read_timeout_s,
            per_worker_share(cfg.limits.max_connections_per_source, cfg.listen.workers),
        ),
        # Connections plus in-flight requests; beyond it uvicorn answers 503 and sockets stop growing.
        limit_concurrency=cfg.limits.max_connections,
        lifespan="off",
        access_log=False,
        proxy_headers=False,  # the gateway is the edge: no X-Forwarded-* rewriting per request
        server_header=False,
        log_config=None,
        timeout_keep_alive=cfg.limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn takes a float
        timeout_graceful_shutdown=int(cfg.drain.timeout_s),
        backlog=2048,
    )
