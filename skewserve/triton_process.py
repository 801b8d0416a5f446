"""Start, watch and stop real tritonserver processes, one or many, each tagged with a region."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from skewserve.errors import ModelLoadError, PortInUse, TritonStartError
from skewserve.ports import free_port, port_is_free
from skewserve.triton_dist import PreparedTriton, prepare_triton, server_environment

logger = logging.getLogger(__name__)

_LOAD_FAILURE = re.compile(
    r"(failed to load '.*|UNAVAILABLE: .*|Invalid argument.*|Poll failed for model directory .*|"
    r"Error parsing text-format .*|error: creating server: .*)"
)
_PORT_TAKEN = re.compile(
    r"(Address already in use|Failed to listen on|Socket '.*' already in use|failed to start .* service)",
    re.I,
)


def _answers_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def serves_metrics(extra_args: Sequence[str]) -> bool:
    """Whether Triton's own flags leave its metrics endpoint on (it is on unless
    `--allow-metrics` says false, in either of getopt's spellings)."""
    args = list(extra_args)
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith("--allow-metrics=") else None
        if arg == "--allow-metrics" and i + 1 < len(args):
            value = args[i + 1]
        if value is not None and value.strip().lower() in ("false", "0", "off"):
            return False
    return True


def response_cache_config(size_mb: int) -> tuple[str, ...]:
    """`--cache-config` values for Triton's local response cache of `size_mb` MiB (0: off).

    Only models whose config says `response_cache { enable: true }` use it
    (`skewserve export --response-cache`); the others are unaffected.
    """
    if size_mb < 0:
        raise ValueError(f"response cache size must be >= 0 MiB, got {size_mb}")
    return (f"local,size={size_mb * 1024 * 1024}",) if size_mb else ()


def start_servers(servers: Sequence[TritonServer]) -> None:
    """Launch every server, then wait for each: their model loads overlap. On any failure all are
    stopped and the failure raised."""
    if len({id(server) for server in servers}) != len(servers):
        raise ValueError("start_servers: a server is listed twice; list each once")
    prepared: PreparedTriton | None = None
    try:
        for server in servers:
            if server._prepared is None:
                server._prepared = prepared = prepared or prepare_triton()
            server._choose_ports()
            server._launch(server._prepared)
        for server in servers:
            try:
                server._wait_ready()
            except PortInUse:
                if server._fixed_ports:
                    raise
                server.stop()
                server.start()
    except BaseException:
        stop_servers(servers)
        raise


def stop_servers(servers: Iterable[TritonServer]) -> None:
    """Stop every server: all are signalled first, then each is waited for up to its own bound.

    Triton checks once a second whether its models have unloaded, so one graceful stop takes two to
    four seconds; signalled together, a fleet stops in about the time of one.
    """
    deadlines = [(server, server._terminate()) for server in servers]
    failure: BaseException | None = None
    for server, deadline in deadlines:
        try:  # after an interrupt (Ctrl-C, a test's timeout) the rest are killed at once, not left
            server._reap(deadline if failure is None else time.monotonic())
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


class TritonServerSpec(BaseModel):
    """What one tritonserver process serves and where; unset ports are chosen free at start."""

    model_config = ConfigDict(frozen=True)

    repository: Path
    region: str = "local"
    name: str = "triton-0"
    host: str = "127.0.0.1"
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    model_config_name: str | None = "local"
    model_control_mode: str = "none"
    load_models: tuple[str, ...] = ()
    cache_config: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    log_verbose: int = 0
    startup_timeout_s: float = Field(default=120.0, gt=0)
    stop_timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("model_control_mode")
    @classmethod
    def _mode(cls, value: str) -> str:
        if value not in {"none", "poll", "explicit"}:
            raise ValueError(f"model_control_mode must be none, poll or explicit, got {value!r}")
        return value

    @field_validator("repository")
    @classmethod
    def _repo_exists(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(
                f"model repository {value} is not a directory; export a model first (skewserve export)"
            )
        return value.resolve()


class TritonServer:
    """One running tritonserver: start() blocks until /v2/health/ready answers and the metrics port
    listens, stop() always reaps it."""

    def __init__(self, spec: TritonServerSpec, log_dir: Path, prepared: PreparedTriton | None = None) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir)
        self._prepared = prepared
        self._proc: subprocess.Popen[bytes] | None = None
        self._fixed_ports = any(p is not None for p in (spec.http_port, spec.grpc_port, spec.metrics_port))
        self._reap_lock = threading.Lock()  # one thread reaps: a second finds the server gone
        self.http_port = spec.http_port or 0
        self.grpc_port = spec.grpc_port or 0
        self.metrics_port = spec.metrics_port or 0
        self.log_path = self.log_dir / f"{spec.region}-{spec.name}.log"

    # -- addresses -------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{self.spec.host}:{self.http_port}"

    @property
    def http_address(self) -> str:
        return f"{self.spec.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.spec.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.spec.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------
    def command(self, prepared: PreparedTriton) -> list[str]:
        spec = self.spec
        cmd = [
            str(prepared.binary),
            f"--model-repository={spec.repository}",
            f"--backend-directory={prepared.backend_directory}",
            f"--cache-directory={prepared.cache_directory}",
            f"--http-address={spec.host}",
            f"--grpc-address={spec.host}",
            f"--metrics-address={spec.host}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--model-control-mode={spec.model_control_mode}",
            f"--exit-timeout-secs={max(1, int(spec.stop_timeout_s) - 1)}",
            f"--log-verbose={spec.log_verbose}",
            "--allow-gpu-metrics=false",
            f"--id={spec.region}-{spec.name}",
        ]
        if spec.model_config_name:
            cmd.append(f"--model-config-name={spec.model_config_name}")
        cmd += [f"--load-model={m}" for m in spec.load_models]
        cmd += [f"--cache-config={c}" for c in spec.cache_config]
        cmd += list(spec.extra_args)
        return cmd

    def start(self) -> TritonServer:
        """Start the server and wait until it is ready; raise with Triton's own reason if it is not."""
        prepared = self._prepared or prepare_triton()
        attempts = 1 if self._fixed_ports else 3
        for attempt in range(attempts):
            self._choose_ports()
            try:
                self._launch(prepared)
                self._wait_ready()
                return self
            except PortInUse:
                self.stop()
                if attempt + 1 == attempts:
                    raise
                logger.warning("port race for %s, retrying with new ports", self.spec.name)
        raise AssertionError("unreachable")

    def _choose_ports(self) -> None:
        """Free ports for a launch: fresh ones for every port the spec leaves unset (new ones on each
        try); a port the spec fixes must be free, or PortInUse names it."""
        if not self._fixed_ports:
            self.http_port, self.grpc_port, self.metrics_port = (free_port(), free_port(), free_port())
            return
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            if port and not port_is_free(port, self.spec.host):
                raise PortInUse(
                    f"port {port} on {self.spec.host} is already in use; choose another for "
                    f"{self.spec.region}/{self.spec.name} or leave it unset to pick a free one"
                )
        self.metrics_port = self.metrics_port or free_port()
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()

    def _launch(self, prepared: PreparedTriton) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed in stop()
        logger.info(
            "starting tritonserver %s/%s: http %s grpc %s",
            self.spec.region,
            self.spec.name,
            self.http_port,
            self.grpc_port,
        )
        # A new session makes the server and its Python-backend stubs one process group to signal.
        try:
            self._proc = subprocess.Popen(
                self.command(prepared),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_environment(),
                start_new_session=True,
            )
        except BaseException:  # no server to stop later: its log is closed now
            log.close()
            raise
        self._log_handle = log

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _failure_reason(self) -> str:
        text = self.log_text()
        lines = [m.group(1).strip() for m in _LOAD_FAILURE.finditer(text)]
        return "; ".join(dict.fromkeys(lines)) or "\n".join(text.strip().splitlines()[-15:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        url = f"{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is None:  # another thread stopped it (a shutdown during a scale-up)
                raise TritonStartError(f"tritonserver {self.spec.name} was stopped while starting")
            code = proc.poll()
            if code is not None:
                text = self.log_text()
                if _PORT_TAKEN.search(text):
                    raise PortInUse(
                        f"tritonserver {self.spec.name} could not bind its ports: {self._failure_reason()}"
                    )
                reason = self._failure_reason()
                if "failed to load" in text or "UNAVAILABLE" in text or "Poll failed" in text:
                    raise ModelLoadError(
                        f"tritonserver {self.spec.region}/{self.spec.name} exited ({code}) because a model "
                        f"failed to load: {reason} (full log: {self.log_path})"
                    )
                raise TritonStartError(
                    f"tritonserver {self.spec.name} exited with code {code}: {reason} (log: {self.log_path})"
                )
            if _answers_ready(url) and self._metrics_listening():
                return
            time.sleep(0.1)
        reason = self._failure_reason()
        self.stop()
        raise TritonStartError(
            f"tritonserver {self.spec.name} not ready after {self.spec.startup_timeout_s:.0f}s: {reason} (log: {self.log_path})"
        )

    def _metrics_listening(self) -> bool:
        """Triton opens its metrics port after HTTP already answers ready (tens of milliseconds
        later), so a scrape right after start() would be refused; a server counts as started once
        every endpoint it was given listens. A server told not to serve metrics has none to wait for."""
        if not serves_metrics(self.spec.extra_args):
            return True
        try:
            with socket.create_connection((self.spec.host, self.metrics_port), timeout=1.0):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the stop bound; idempotent."""
        stop_servers([self])

    def _terminate(self) -> float:
        """SIGTERM the process group if it runs; the moment by which it must have exited."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        return time.monotonic() + self.spec.stop_timeout_s

    def _reap(self, deadline: float) -> None:
        """Wait for the exit until `deadline`, then SIGKILL whatever of the group is left."""
        with self._reap_lock:
            self._reap_locked(deadline)

    def _reap_locked(self, deadline: float) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning(
                "tritonserver %s ignored SIGTERM for %.0fs, killing it",
                self.spec.name,
                self.spec.stop_timeout_s,
            )
        # Stubs can outlive the server by a moment; the group kill reaps whatever is left.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        handle = getattr(self, "_log_handle", None)
        if handle is not None:
            handle.close()
        self._proc = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TritonFleet:
    """Several tritonserver processes across regions, started together and stopped together."""

    def __init__(
        self, specs: Sequence[TritonServerSpec], log_dir: Path, prepared: PreparedTriton | None = None
    ) -> None:
        self.servers = [TritonServer(spec, log_dir, prepared) for spec in specs]

    @classmethod
    def for_regions(
        cls,
        repository: Path,
        regions: Iterable[str],
        per_region: int,
        log_dir: Path,
        **spec_fields: object,
    ) -> TritonFleet:
        specs = [
            TritonServerSpec(repository=repository, region=region, name=f"triton-{i}", **spec_fields)  # type: ignore[arg-type]
            for region in regions
            for i in range(per_region)
        ]
        return cls(specs, log_dir)

    def start(self) -> TritonFleet:
        """Launch every server, then wait for each: model loading overlaps across servers."""
        start_servers(self.servers)
        return self

    def stop(self) -> None:
        stop_servers(self.servers)

    def by_region(self) -> dict[str, list[TritonServer]]:
        out: dict[str, list[TritonServer]] = {}
        for server in self.servers:
            out.setdefault(server.spec.region, []).append(server)
        return out

    def __enter__(self) -> TritonFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
