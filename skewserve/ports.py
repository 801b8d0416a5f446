"""Free loopback ports for servers the stack starts.

A port chosen here is bound later by another process (tritonserver, redis-server, a gateway), so
between the choice and the bind somebody else may take it. Two kinds of somebody matter:

- the kernel, which hands ports of its ephemeral range to every `bind(0)` and outgoing connection;
- other processes choosing ports the same way at the same time (parallel test workers).

`SKEWSERVE_PORT_RANGE=LOW-HIGH` removes both: ports are then drawn from that range, which callers
keep outside the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`) and disjoint
between parallel runs (the test suite gives each pytest-xdist worker its own). Without it, the
kernel chooses (fine for one stack on a workstation; servers retry on a clash).
"""

from __future__ import annotations

import os
import random
import socket

PORT_RANGE_ENV = "SKEWSERVE_PORT_RANGE"

# Ports this process has handed out, so it never hands the same one twice while the first taker
# may not have bound it yet. Other processes sharing the range draw at random from it.
_handed_out: set[int] = set()


def port_range() -> range | None:
    """The range `SKEWSERVE_PORT_RANGE` names, or None when unset."""
    raw = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not raw:
        return None
    try:
        low, high = (int(part) for part in raw.split("-", 1))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={raw!r}: expected LOW-HIGH, e.g. 20000-21999") from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={raw!r}: expected 1024 <= LOW <= HIGH <= 65535")
    return range(low, high + 1)


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that nothing listens on right now (the caller must bind it soon)."""
    ports = port_range()
    if ports is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    candidates = [p for p in ports if p not in _handed_out]
    if not candidates:  # the whole range went out once: start over (the first takers are long bound)
        _handed_out.clear()
        candidates = list(ports)
    random.shuffle(candidates)
    for port in candidates:
        if _bindable(port, host):
            _handed_out.add(port)
            return port
    raise OSError(f"no free port in {PORT_RANGE_ENV}={ports.start}-{ports.stop - 1} on {host}")


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


def consecutive_free_ports(hosts: list[str], count: int = 3) -> tuple[int, ...]:
    """`count` consecutive ports free on every host (every pod of one Service listens on the same ports)."""
    ports = port_range()
    top = ports.stop if ports is not None else 65536
    for _ in range(100):
        base = free_port(hosts[0])
        if base + count <= top and all(port_is_free(base + i, h) for h in hosts for i in range(count)):
            _handed_out.update(range(base, base + count))
            return tuple(range(base, base + count))
    raise RuntimeError(f"no {count} consecutive ports free on all of {hosts}; free some ports and retry")
