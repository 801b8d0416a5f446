"""Run the gateway as a child process (`python -m gateway`) and wait until it serves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from skewserve.errors import SkewserveError


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    host: str
    http_port: int
    grpc_port: int
    log_path: Path
    ops_port: int = 0
    ops_host: str = "127.0.0.1"

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def ops(self) -> str:
        """host:port of the ops listener (/metrics, /admin/upstreams)."""
        host = "127.0.0.1" if self.ops_host in ("0.0.0.0", "") else self.ops_host
        return f"[{host}]:{self.ops_port}" if ":" in host else f"{host}:{self.ops_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGINT (immediate stop, no drain), then SIGKILL after the bound; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_gateway_process(
    config_path: Path,
    log_path: Path,
    host: str = "127.0.0.1",
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> GatewayProcess:
    """Start the gateway on `config_path`; return once it wrote its bound ports, or raise with its log.

    `python`: the interpreter (or a wrapper running one, as a profiler does); this one's by default."""
    ready = config_path.with_suffix(".ready")
    ready.unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                python or sys.executable,
                "-m",
                "gateway",
                "--config",
                str(config_path),
                "--ready-file",
                str(ready),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SkewserveError(
                f"gateway exited with {proc.returncode}: {log_path.read_text(errors='replace')[-2000:]}"
            )
        if ready.exists() and ready.read_text().strip():
            ports = json.loads(ready.read_text())
            return GatewayProcess(
                proc,
                host,
                ports["http_port"],
                ports["grpc_port"],
                log_path,
                ports["ops_port"],
                ports.get("ops_host", "127.0.0.1"),
            )
        time.sleep(0.05)
    proc.kill()
    proc.wait(5)
    raise SkewserveError(f"gateway not ready after {timeout_s:.0f}s; see {log_path}")
