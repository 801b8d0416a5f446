"""`listen.workers` > 1: this process supervises worker processes and owns what they share.

Each worker is a whole gateway (gateway/server.py with a `WorkerSlot`): it binds the public HTTP
port with SO_REUSEPORT (the kernel spreads connections over the workers), serves gRPC calls on its
own bridge socket, and its ops listener on a private unix socket. The supervisor holds the public
gRPC socket and runs HAProxy over it (streams spread over the workers' bridge sockets, the least
busy first), serves the ops port (metrics summed over workers, each worker's fleet view), restarts
a worker or HAProxy that dies, and passes SIGTERM (drain), SIGINT and SIGHUP (reload) on.

State the workers share goes through Redis: the response cache (cache.backend: redis) and the
rate-limit buckets (config validation requires that when limits are set). Each worker probes the
fleet itself, so all see the same readiness; passive ejection is per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway.config import GatewayConfig
from gateway.fronts.grpc_plane import WorkerSlot, data_plane_spec, keep_running
from gateway.fronts.http_protocol import uvicorn_config
from gateway.fronts.listen import bind_listener, bind_shared, write_ready_file
from gateway.operations.metrics_merge import merge_expositions
from gateway.upstream.haproxy import HaproxyProcess, die_with_parent, runtime_dir
from gateway.upstream.http_client import HttpPool

logger = logging.getLogger(__name__)
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
WORKER_START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = 0.25


class WorkerProcess:
    def __init__(self, slot: WorkerSlot, config_file: Path) -> None:
        self.slot = slot
        self.config_file = config_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.restart_at = 0.0
        self.backoff_s = RESTART_BACKOFF_S
        self.ops = HttpPool(f"worker-{slot.index}:0", unix_path=str(slot.ops_socket), max_idle=4)

    def start(self) -> None:
        self.slot.ready_file.unlink(missing_ok=True)
        spec = f"{self.slot.index}:{self.slot.http_port}:{self.slot.directory}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--config", str(self.config_file), "--worker", spec],
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # a supervisor killed outright takes its workers along
        )
        self.started_at = time.monotonic()

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def wait_ready(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.slot.ready_file.exists():
            code = self.exited()
            if code is not None:
                raise RuntimeError(f"gateway worker {self.slot.index} exited with code {code} while starting")
            if loop.time() > deadline:
                raise RuntimeError(f"gateway worker {self.slot.index} not ready within {timeout_s:g}s")
            await asyncio.sleep(0.05)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    async def get(self, path: bytes) -> bytes | None:
        try:
            resp = await self.ops.request(b"GET", path, b"", None, 5.0)
        except Exception as exc:  # a worker restarting: its part is missing from this answer
            logger.warning("worker %d did not answer %s: %s", self.slot.index, path.decode(), exc)
            return None
        return resp.body if resp.status == 200 else None


def build_supervisor_ops(workers: list[WorkerProcess]) -> FastAPI:
    api = FastAPI(title="skewserve gateway ops (workers)", docs_url=None, redoc_url=None, openapi_url=None)

    @api.get("/metrics")
    async def metrics() -> Response:
        bodies = await asyncio.gather(*(w.get(b"/metrics") for w in workers))
        merged = merge_expositions(
            {str(w.slot.index): b.decode() for w, b in zip(workers, bodies, strict=True) if b is not None}
        )
        return Response(merged, media_type=_PROMETHEUS)

    @api.get("/admin/upstreams")
    async def upstreams() -> JSONResponse:
        bodies = await asyncio.gather(*(w.get(b"/admin/upstreams") for w in workers))
        return JSONResponse({"workers": [json.loads(b) if b is not None else None for b in bodies]})

    @api.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @api.get("/v2/health/ready")
    async def ready() -> Response:
        answers = await asyncio.gather(
            *(w.ops.request(b"GET", b"/v2/health/ready", b"", None, 2.0) for w in workers),
            return_exceptions=True,
        )
        up = any(not isinstance(a, BaseException) and a.status == 200 for a in answers)
        return Response(status_code=200 if up else 400)

    return api


async def _keep_workers(workers: list[WorkerProcess], stopping: asyncio.Event) -> None:
    """Start a worker that died again, backing off (doubling to 30 s) while it keeps dying early."""
    while not stopping.is_set():
        await asyncio.sleep(0.5)
        now = time.monotonic()
        for w in workers:
            code = w.exited()
            if code is None or stopping.is_set():
                continue
            if w.restart_at == 0.0:
                lived = now - w.started_at
                w.backoff_s = RESTART_BACKOFF_S if lived > 60 else min(w.backoff_s * 2, 30.0)
                w.restart_at = now + (0.0 if lived > 60 else w.backoff_s)
                logger.error(
                    "gateway worker %d exited with code %s after %.1fs; starting it again in %.1fs",
                    w.slot.index,
                    code,
                    lived,
                    w.restart_at - now,
                )
            if now >= w.restart_at:
                w.restart_at = 0.0
                w.start()


async def supervise(cfg: GatewayConfig, ready_file: Path | None, config_path: Path | None) -> None:
    listen = cfg.listen
    # Bound first, as in a single process: a taken port fails the start in one line.
    with contextlib.ExitStack() as unwind:
        http_hold = unwind.enter_context(bind_shared(listen.host, listen.http_port, "http_port"))
        ops_sock = unwind.enter_context(bind_listener(listen.ops_host, listen.ops_port, "ops_port"))
        grpc_sock = unwind.enter_context(bind_listener(listen.host, listen.grpc_port, "grpc_port"))
        unwind.pop_all()  # all bound: closed in the `finally` below
    directory = runtime_dir()
    http_port = int(http_hold.getsockname()[1])
    config_file = config_path
    if config_file is None:  # started from code: hand the workers the validated config
        config_file = directory / "config.json"
        config_file.write_text(cfg.model_dump_json())
    workers = [WorkerProcess(WorkerSlot(i, directory, http_port), config_file) for i in range(listen.workers)]
    stopping = asyncio.Event()
    haproxy = HaproxyProcess(data_plane_spec(cfg, grpc_sock, directory, len(workers)), directory)
    tasks: list[asyncio.Task[Any]] = []
    ops_server: uvicorn.Server | None = None
    loop = asyncio.get_running_loop()

    def forward(sig: int) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            stopping.set()
        for w in workers:
            w.signal(sig)

    # Before anything starts: a SIGTERM while workers start stops them all, HAProxy too.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, forward, sig)
    try:
        # HAProxy first: workers probe Triton over gRPC through it before they call themselves ready.
        await haproxy.start()
        for w in workers:
            w.start()
        ready: asyncio.Future[Any] = asyncio.gather(*(w.wait_ready(WORKER_START_TIMEOUT_S) for w in workers))
        stop_wait: asyncio.Future[Any] = loop.create_task(stopping.wait())
        await asyncio.wait({ready, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if stopping.is_set():
            ready.cancel()
            return
        stop_wait.cancel()
        await ready
        # The same bounds as every other listener: the header-read timer, the connection limit.
        ops_server = uvicorn.Server(uvicorn_config(build_supervisor_ops(workers), cfg))
        ops_server.config.load()
        ops_server.lifespan = ops_server.config.lifespan_class(ops_server.config)
        await ops_server.startup(sockets=[ops_sock])
        tasks = [loop.create_task(_keep_workers(workers, stopping)), loop.create_task(keep_running(haproxy))]
        grpc_port = int(grpc_sock.getsockname()[1])
        logger.info(
            "gateway ready: %d workers, http %s:%d grpc %s:%d ops %s:%d, home region %s",
            len(workers),
            listen.host,
            http_port,
            listen.host,
            grpc_port,
            listen.ops_host,
            ops_sock.getsockname()[1],
            cfg.home_region,
        )
        if ready_file is not None:
            write_ready_file(
                ready_file,
                {
                    "http_port": http_port,
                    "grpc_port": grpc_port,
                    "ops_port": ops_sock.getsockname()[1],
                    "ops_host": listen.ops_host,
                    "workers": len(workers),
                    "pid": os.getpid(),
                },
            )
        await stopping.wait()
        # Workers drain (they stop answering ready, finish in-flight calls) and exit on their own.
        await asyncio.gather(*(asyncio.to_thread(w.proc.wait) for w in workers if w.proc is not None))
    finally:
        stopping.set()
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for w in workers:
            w.signal(signal.SIGKILL)
            await w.ops.close()
        await haproxy.stop()
        if ops_server is not None:
            ops_server.should_exit = True
            await ops_server.shutdown()
        for s in (http_hold, ops_sock, grpc_sock):
            s.close()
        shutil.rmtree(directory, ignore_errors=True)
        logger.info("gateway stopped")
