"""Listening sockets for the gateway's three listeners, bound before anything else starts.

A taken port must fail the start with one line naming the port and the config field that chose it
(`listen.http_port`...), not a traceback from deep inside uvicorn or grpc, and before the gateway
probes any server: so the sockets are bound here first and handed to the servers.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any


class ListenError(OSError):
    """A listener could not be bound; the message names the config field and what to do."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _refusal(field: str, host: str, port: int, exc: OSError) -> ListenError:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return ListenError(
            f"listen.{field} {where} is already in use; stop what holds it or choose another listen.{field}"
        )
    if exc.errno == errno.EACCES:
        return ListenError(f"listen.{field} {where} needs privileges to bind; choose a port above 1023")
    return ListenError(
        f"listen.{field} {where} cannot be bound ({exc.strerror}); check listen.{field} and the host"
    )


def _bind(host: str, port: int, field: str, *, reuseport: bool, listen: bool) -> socket.socket:
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT sockets
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise _refusal(field, host, port, exc) from None
    sock.setblocking(False)
    return sock


def bind_listener(host: str, port: int, field: str) -> socket.socket:
    """A bound, listening TCP socket for uvicorn (port 0 = a free port); ListenError names `field`."""
    return _bind(host, port, field, reuseport=False, listen=True)


def check_free(host: str, port: int, field: str) -> None:
    """Raise ListenError if `port` cannot be bound now (for grpc, which binds its own sockets)."""
    if port == 0:
        return
    bind_listener(host, port, field).close()


def refused(field: str, host: str, port: int) -> ListenError:
    """The error for a bind that failed where the cause is not known (grpc returns only 0)."""
    return _refusal(field, host, port, OSError(errno.EADDRINUSE, "in use"))


def bind_shared(host: str, port: int, field: str) -> socket.socket:
    """A bound, not yet listening TCP socket with SO_REUSEPORT: the supervisor's holds the port (so
    port 0 resolves once) and each worker binds its own, listening once it serves (uvicorn's start);
    the kernel spreads new connections over the listening ones only."""
    return _bind(host, port, field, reuseport=True, listen=False)


def bind_unix(path: str) -> socket.socket:
    """A listening unix socket (a worker's private ops listener), replacing a stale file."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(256)
    sock.setblocking(False)
    return sock


def write_ready_file(path: Path, bound: dict[str, Any]) -> None:
    """What was bound (ports chosen free included), for whoever started the gateway to read."""
    path.write_text(json.dumps(bound) + "\n")
