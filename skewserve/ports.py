"""Free loopback ports for servers the stack starts."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that nothing listens on right now (the caller must bind it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when `port` can be bound on `host` by a server (which sets SO_REUSEADDR, as Triton does).

    Without SO_REUSEADDR, connections in TIME_WAIT from a killed server would look like a listener.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
