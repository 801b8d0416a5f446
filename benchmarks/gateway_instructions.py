"""The gateway's CPU instructions per request, counted by callgrind: a figure the shared machine's
load does not move.

CPU time per request moves by a quarter between rounds on these 2 shared cores (docs/benchmarks.md),
so a change of a few percent cannot be read from it. valgrind's callgrind counts the instructions a
process executes, the same for the same code and inputs whatever else the machine runs. Here each
gateway runs under callgrind (one process, the compiled build unless `--build pure`), a sequential
keep-alive client sends `--requests` HTTP JSON infer requests after a warm-up, each in one write as
wrk sends them (http.client writes the head and the body apart, and whether the gateway reads them
in one read or two then depends on timing: two reads run another path), and the count between
the two is divided by the number of requests: a cache hit (model `bench_gwcache`) and an uncached
request forwarded to a real Triton (model `bench`; Triton's own instructions are not counted); and
a gRPC ModelInfer of the same model and row, uncached, sequential calls on one HTTP/2 connection (the
worker's count: HAProxy, which ends the client's HTTP/2 in its own process, is not counted).
`--against NAME=DIR` measures another checkout's gateway (its sources and compiled extensions, run by
this checkout's Python) the same way, and each row prints this build / that one.

Instructions are not seconds (a syscall's kernel time, cache misses and SHA extensions the CPU has
but valgrind's CPU lacks are not in them), so this reads where Python-level work went, not
throughput: the goals stay with `make bench-gateway-goals`. valgrind slows the gateway about 50x,
so a row of 2,000 requests takes about a minute and a half (its gateway's start-up included).

Usage: python benchmarks/gateway_instructions.py [--requests 2000] [--against NAME=DIR ...]
Needs valgrind (Debian: apt-get install valgrind).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gateway_bench import MODEL_INFER, ROW, grpc_request, prepare_repository  # noqa: E402
from benchmarks.gateway_goals import parse_against  # noqa: E402
from loadtests.wire import json_request  # noqa: E402
from skewserve.gateway_process import start_gateway_process  # noqa: E402
from skewserve.triton_process import TritonServer, TritonServerSpec  # noqa: E402

# row -> (protocol, model)
MODELS = {
    "cache hit": ("http", "bench_gwcache"),
    "uncached": ("http", "bench"),
    "gRPC uncached": ("grpc", "bench"),
}
CACHED_MODEL = MODELS["cache hit"][1]
WARM_UP = 200


@dataclass
class Counted:
    checkout: str
    path: str
    per_request: float


def _total(out: Path) -> int:
    """The `summary:` line of a callgrind dump: instructions executed since the last zeroing."""
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"{out} has no summary line: not a callgrind dump")


class OneWriteClient:
    """A keep-alive HTTP/1.1 client that sends each request, head and body, in one write."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.pending = b""

    def post(self, model: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: bench\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head += f"Content-Length: {len(body)}\r\n\r\n"
        self.sock.sendall(head.encode() + body)
        while b"\r\n\r\n" not in self.pending:
            self.pending += self._recv()
        answer_head, self.pending = self.pending.split(b"\r\n\r\n", 1)
        lines = answer_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(
            int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length"
        )
        while len(self.pending) < length:
            self.pending += self._recv()
        answer, self.pending = self.pending[:length], self.pending[length:]
        return status, answer

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise RuntimeError("the gateway closed the connection")
        return data

    def close(self) -> None:
        self.sock.close()


class HttpInfer:
    """One JSON infer request of `model` per call, by the one-write client: None when answered 200,
    else what went wrong."""

    def __init__(self, host: str, http_port: int, grpc_port: int, model: str) -> None:
        self.client = OneWriteClient(host, http_port, timeout_s=300)
        self.model = model
        self.body, self.headers = json_request(ROW)

    def __call__(self) -> str | None:
        status, answer = self.client.post(self.model, self.body, self.headers)
        return None if status == 200 else f"HTTP {status} {answer[:200]!r}"

    def close(self) -> None:
        self.client.close()


class GrpcInfer:
    """One ModelInfer call of `model` per call on one channel (grpcio, the message serialised once)."""

    def __init__(self, host: str, http_port: int, grpc_port: int, model: str) -> None:
        self.channel = grpc.insecure_channel(f"{host}:{grpc_port}")
        self.call = self.channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)
        self.message = grpc_request(model)

    def __call__(self) -> str | None:
        try:
            self.call(self.message, timeout=300)
        except grpc.RpcError as exc:
            return f"gRPC {exc.code().name} {exc.details()}"  # type: ignore[attr-defined]
        return None

    def close(self) -> None:
        self.channel.close()


CLIENTS = {"http": HttpInfer, "grpc": GrpcInfer}


def _send(infer: HttpInfer | GrpcInfer, model: str, n: int) -> None:
    for _ in range(n):
        failed = infer()
        if failed is not None:
            raise RuntimeError(f"{model}: {failed}")


def _wait_routable(infer: HttpInfer | GrpcInfer, model: str) -> None:
    """Until the gateway's first probe has found the model (valgrind slows its start)."""
    deadline = time.monotonic() + 300
    while (failed := infer()) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model}: still {failed} after 300 s under valgrind")
        time.sleep(0.5)


def count(
    checkout: Path,
    triton: TritonServer,
    work: Path,
    name: str,
    protocol: str,
    model: str,
    requests: int,
    build: str,
) -> float:
    """Instructions per request of one gateway of `checkout` under callgrind."""
    wrapper = work / f"{name}.sh"
    dump = work / f"{name}.callgrind"
    wrapper.write_text(
        f"#!/bin/sh\ncd {checkout}\nexec valgrind --tool=callgrind --callgrind-out-file={dump}.%p "
        f'{sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    cfg = {
        "home_region": "local",
        "listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0},
        "log_json": True,
        "cache": {"backend": "memory", "models": [CACHED_MODEL]},
        # Probes are not requests: one at start, then none while counting.
        "health": {"interval_s": 3600.0, "timeout_s": 60.0},
        "regions": [
            {
                "name": "local",
                "servers": [{"name": "a", "http": triton.http_address, "grpc": triton.grpc_address}],
            }
        ],
    }
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {"SKEWSERVE_GATEWAY_BUILD": build, "PYTHONPATH": str(checkout)}
    gateway = start_gateway_process(config, work / f"{name}.log", timeout_s=600, env=env, python=str(wrapper))
    infer = CLIENTS[protocol](gateway.host, gateway.http_port, gateway.grpc_port, model)
    try:
        _wait_routable(infer, model)
        _send(infer, model, WARM_UP)
        pid = str(gateway.proc.pid)
        subprocess.run(["callgrind_control", "--zero", pid], check=True, capture_output=True)
        _send(infer, model, requests)
        subprocess.run(["callgrind_control", "--dump=measured", pid], check=True, capture_output=True)
    finally:
        infer.close()
        gateway.proc.terminate()
        gateway.proc.wait(120)
    log = (work / f"{name}.log").read_text(errors="replace")
    if "does not match its sources" in log:
        raise RuntimeError(f"{checkout}: its compiled build is stale; run `make setup` there")
    (measured,) = work.glob(f"{name}.callgrind.*.1")  # the dump taken after the counted requests
    return _total(measured) / requests


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="counted requests per row")
    parser.add_argument("--build", choices=("compiled", "pure"), default="compiled")
    parser.add_argument(
        "--against", type=parse_against, action="append", default=[], help="NAME=DIR: another checkout"
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind is not installed: apt-get install valgrind (Debian), then run this again")
    checkouts = {"this": ROOT, **dict(args.against)}
    print(
        f"# gateway instructions per request (callgrind), {platform.machine()}, Python {platform.python_version()}"
    )
    print(
        f"# {args.requests} sequential keep-alive requests per row after {WARM_UP} warm-up; build {args.build}"
    )
    rows: list[Counted] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = prepare_repository(work)
        triton = TritonServer(TritonServerSpec(repository=repo, name="a"), work / "logs").start()
        try:
            for path, (protocol, model) in MODELS.items():
                for label, checkout in checkouts.items():
                    name = f"{label}-{protocol}-{model}"
                    n = count(checkout, triton, work, name, protocol, model, args.requests, args.build)
                    rows.append(Counted(label, path, n))
                    print(f"{path:13s} {label:>10s} {n:12,.0f}", flush=True)
        finally:
            triton.stop()
    print()
    others = list(checkouts)[1:]
    print("| " + " | ".join(["request", *checkouts, *(f"this / {o}" for o in others)]) + " |")
    print("|---|" + "---:|" * (len(checkouts) + len(others)))
    for path in MODELS:
        counts = {r.checkout: r.per_request for r in rows if r.path == path}
        cells = [f"{counts[c]:,.0f}" for c in checkouts] + [
            f"{counts['this'] / counts[o]:.3f}x" for o in others
        ]
        print("| " + " | ".join([path, *cells]) + " |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")  # dict layouts alike from one run to the next
    main()
