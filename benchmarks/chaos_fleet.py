"""The processes of `make chaos` besides the project's own wrappers (skewserve/triton_process.py,
skewserve/gateway_process.py): the bucket as Triton sees it, controller replicas as separate
`skewserve controller` processes, and the address gateways reach "the controller" at.

- `BucketMirror`: the pip tritonserver has no S3 filesystem (the NGC image reads `s3://` itself), so
  the servers read a folder kept equal to the bucket: copied whole at start, then every write the
  store accepts is applied before its writer hears of it (the fault proxy's `on_stored`), as S3's
  read-after-write consistency gives Triton in a cluster. Only the controllers' storage calls go
  through the faults; Triton's own reads of the bucket do not.
- `ControllerReplica`: one `skewserve controller --leader-election` process, SIGKILLed and
  restarted as a pod is; its leader gauge and pass counter read from its `/metrics`.
- `LeaderAddress`: a loopback port forwarding each connection to the replica that leads now (what
  a Kubernetes Service over the replicas' readiness probe gives the gateways).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

_METRIC = re.compile(r"^(skewserve_controller_\w+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


class BucketMirror:
    def __init__(self, client: Any, bucket: str, prefix: str, dest: Path) -> None:
        self.client, self.bucket, self.prefix, self.dest = client, bucket, prefix.strip("/"), dest
        self._lock = threading.Lock()
        self.writes = 0

    def _path(self, key: str) -> Path | None:
        rel = key.removeprefix(self.prefix + "/") if self.prefix else key
        return None if rel == key and self.prefix else self.dest / rel

    def _write(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.mirror")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a server never reads half a file

    def sync(self) -> None:
        """Copy every object under the prefix (model cards last: a version is complete once its card is)."""
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + "/"
        ):
            keys += [o["Key"] for o in page.get("Contents", [])]
        with self._lock:
            for key in sorted(keys, key=lambda k: k.endswith("model_card.json")):
                path = self._path(key)
                if path is not None:
                    self._write(path, self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def on_stored(self, method: str, path: str, body: bytes) -> None:
        """The fault proxy's hook: `path` is `/bucket/key` of a write the store accepted."""
        bucket, _, key = path.lstrip("/").partition("/")
        target = self._path(key) if bucket == self.bucket else None
        if target is None:
            return
        with self._lock:
            self.writes += 1
            if method == "DELETE":
                target.unlink(missing_ok=True)
            else:
                self._write(target, body)


class ControllerReplica:
    def __init__(self, slot: int, port: int, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.slot, self.port, self.args, self.env, self.log_dir = slot, port, args, env, log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.unexpected_exits: list[str] = []

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"controller-{self.slot}.log"

    def start(self) -> None:
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"=== start {self.starts} ===\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skewserve", "controller", *self.args]
                + ["--listen", f"127.0.0.1:{self.port}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited_on_its_own(self) -> bool:
        """Whether the process ended without being killed here (noted, and restarted by the caller)."""
        if self.proc is None or self.proc.poll() is None:
            return False
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
        self.unexpected_exits.append(f"exit {self.proc.returncode}: {' '.join(tail)[:200]}")
        self.proc = None
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def metrics(self) -> dict[str, float] | None:
        """Its unlabelled and summed controller metrics, or None when it does not answer."""
        if not self.running():
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        out: dict[str, float] = {}
        for name, value in _METRIC.findall(text):
            out[name] = out.get(name, 0.0) + float(value)
        return out


class LeaderAddress:
    """127.0.0.1:`port` forwarding to the port `leader()` names (None: the connection is refused)."""

    def __init__(self, leader: Any) -> None:
        self.leader = leader
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="leader-address", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> LeaderAddress:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        port = self.leader()
        try:
            if port is None:
                raise ConnectionRefusedError("no replica leads now")
            up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))

    def stop(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()
