"""What carries the gateway's gRPC: HAProxy in front of the worker (default) or grpc.aio in it.

Both serve the same `GrpcFront` methods; the HAProxy plane also carries upstream gRPC calls
(`relay`), so that neither end of a proxied call pays grpc.aio's per-call cost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from gateway.config import GatewayConfig
from gateway.fronts.grpc_bridge import BridgeServer
from gateway.fronts.grpc_front import SERVICE, UNARY_METHODS, GrpcFront
from gateway.fronts.grpc_stream import StreamInfer
from gateway.fronts.listen import bind_listener
from gateway.task_stop import cancel_and_wait
from gateway.upstream.grpc_relay import GrpcRelay
from gateway.upstream.haproxy import (
    STREAM_PATH,
    DataPlaneSpec,
    HaproxyProcess,
    bridge_socket,
    inheritable,
    runtime_dir,
    stream_socket,
)

logger = logging.getLogger(__name__)


def tls_pem(cfg: GatewayConfig, directory: Path) -> Path | None:
    """listen.tls as HAProxy reads it: certificate and key in one file, private to this process."""
    tls = cfg.listen.tls
    if tls is None:
        return None
    pem = directory / "tls.pem"
    fd = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        cert = Path(tls.cert_file).read_bytes()
        out.write(cert if cert.endswith(b"\n") else cert + b"\n")
        out.write(Path(tls.key_file).read_bytes())
    return pem


def data_plane_spec(
    cfg: GatewayConfig, grpc_sock: socket.socket, directory: Path, workers: int
) -> DataPlaneSpec:
    limits = cfg.limits
    return DataPlaneSpec(
        grpc_fd=inheritable(grpc_sock),
        worker_sockets=[bridge_socket(directory, i) for i in range(workers)],
        stream_sockets=[stream_socket(directory, i) for i in range(workers)],
        relay_socket=directory / "relay.sock",
        admin_socket=directory / "admin.sock",
        header_read_timeout_s=limits.header_read_timeout_s,
        max_connections=limits.max_connections,
        max_connections_per_source=limits.max_connections_per_source,
        keep_alive_timeout_s=limits.keep_alive_timeout_s,
        stream_idle_timeout_s=limits.stream_idle_timeout_s,
        tls_pem=tls_pem(cfg, directory),
        served_paths=[f"/{SERVICE}/{name}" for name in UNARY_METHODS] + [STREAM_PATH],
        connect_timeout_s=cfg.retries.connect_timeout_s,
        # One HAProxy thread: measured on 2 cores with 2 workers, a second thread cost 40% more CPU
        # per call (72 -> 103 µs) and lowered throughput; one thread carries tens of thousands of calls/s.
        threads=1,
    )


async def serve_streams(front: GrpcFront, path: Path) -> grpc.aio.Server:
    """A worker's grpc.aio server for ModelStreamInfer on a unix socket only HAProxy reaches."""
    limits = front.gw.cfg.limits
    server = grpc.aio.server(
        options=[
            # A caller's open streams times this fits its byte bound: grpc-core holds a message whole
            # before the handler sees it (and counts it), so the bound must be on each message.
            ("grpc.max_receive_message_length", limits.stream_message_bytes),
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.max_concurrent_streams", limits.max_streams),
        ]
    )
    server.add_generic_rpc_handlers((StreamInfer(front.gw).handler(),))
    path.unlink(missing_ok=True)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    return server


async def keep_running(haproxy: HaproxyProcess) -> None:
    """Start HAProxy again whenever it exits (the listening socket stays open meanwhile)."""
    while True:
        await asyncio.sleep(0.5)
        code = haproxy.exited()
        if code is not None:
            logger.error("gRPC data plane: HAProxy exited with code %s; starting it again", code)
            try:
                await haproxy.start()
            except Exception:
                logger.exception("gRPC data plane: HAProxy did not start again; retrying")


class GrpcPlane:
    relay: GrpcRelay | None = None

    def bind(self) -> None:
        """Bind the public gRPC port (ListenError naming listen.grpc_port when taken)."""

    async def start(self, front: GrpcFront) -> int:
        """Serve `front`; returns the bound public port."""
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class WorkerSlot:
    """Where one of several worker processes serves (gateway/supervisor.py owns the directory)."""

    index: int
    directory: Path
    http_port: int

    @property
    def ops_socket(self) -> Path:
        return self.directory / f"ops{self.index}.sock"

    @property
    def ready_file(self) -> Path:
        return self.directory / f"w{self.index}.ready"


class WorkerGrpcPlane(GrpcPlane):
    """A worker's part of the HAProxy plane: its bridge socket; HAProxy is the supervisor's."""

    def __init__(self, cfg: GatewayConfig, directory: Path, index: int) -> None:
        self.cfg = cfg
        self.path = bridge_socket(directory, index)
        self.stream_path = stream_socket(directory, index)
        self.streams: grpc.aio.Server | None = None
        self.relay = GrpcRelay(str(directory / "relay.sock"), cfg.retries.connect_timeout_s)
        self.bridge: BridgeServer | None = None

    async def start(self, front: GrpcFront) -> int:
        self.bridge = BridgeServer(front.methods(), SERVICE, self.cfg.limits, front.gw.bodies, front.precheck)
        await self.bridge.start(self.path)
        self.streams = await serve_streams(front, self.stream_path)
        return 0

    async def stop(self) -> None:
        if self.bridge is not None:
            await self.bridge.stop()
        if self.streams is not None:
            await self.streams.stop(1.0)


class GrpcioPlane(GrpcPlane):
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.front: GrpcFront | None = None

    async def start(self, front: GrpcFront) -> int:
        self.front = front
        listen = self.cfg.listen
        return await front.start(
            listen.host, listen.grpc_port, listen.tls, (StreamInfer(front.gw).handler(),)
        )

    async def stop(self) -> None:
        if self.front is not None:
            await self.front.stop(1.0)


class HaproxyGrpcPlane(GrpcPlane):
    """HAProxy on the public gRPC port and toward Triton; this process serves its bridge socket.

    A HAProxy that dies is started again on the same listening socket (clients see their in-flight
    calls fail with UNAVAILABLE, the next ones succeed)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.directory = runtime_dir()
        self.relay = GrpcRelay(str(self.directory / "relay.sock"), cfg.retries.connect_timeout_s)
        self.sock: socket.socket | None = None
        self.bridge: BridgeServer | None = None
        self.streams: grpc.aio.Server | None = None
        self.haproxy: HaproxyProcess | None = None
        self._watch: asyncio.Task[None] | None = None

    def bind(self) -> None:
        listen = self.cfg.listen
        self.sock = bind_listener(listen.host, listen.grpc_port, "grpc_port")

    async def start(self, front: GrpcFront) -> int:
        assert self.sock is not None, "bind() first"
        # HAProxy first, as the supervisor does: forking it once grpc.aio runs threads in this
        # process (the stream server) could abort the child (gRPC's fork handlers are skipped while
        # other threads call into gRPC). Until the bridge and the stream server listen, HAProxy
        # answers a refused connection with an error; the gateway is not ready before then anyway.
        self.haproxy = HaproxyProcess(data_plane_spec(self.cfg, self.sock, self.directory, 1), self.directory)
        await self.haproxy.start()
        self.bridge = BridgeServer(front.methods(), SERVICE, self.cfg.limits, front.gw.bodies, front.precheck)
        await self.bridge.start(bridge_socket(self.directory, 0))
        self.streams = await serve_streams(front, stream_socket(self.directory, 0))
        self._watch = asyncio.get_running_loop().create_task(keep_running(self.haproxy))
        return int(self.sock.getsockname()[1])

    async def stop(self) -> None:
        if self._watch is not None:
            await cancel_and_wait(self._watch)
        if self.haproxy is not None:
            await self.haproxy.stop()
        if self.bridge is not None:
            await self.bridge.stop()
        if self.streams is not None:
            await self.streams.stop(1.0)
        if self.sock is not None:
            self.sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)
