"""Active health probes and passive outlier ejection.

Active: every interval each server is asked whether it is ready and which model versions are
ready (Triton's repository index), over gRPC or HTTP. A draining server (not ready) or one whose
model was unloaded gets no new requests for it. Passive: consecutive failures or timeouts on real
traffic eject a server for base x 2^(ejections-1) seconds (capped), after which it is re-admitted;
a success resets the failure count, and a clean probe after re-admission forgives past ejections.
What counts as a failure is decided by the dispatcher (never a client's own deadline). At most
`max_ejection_percent` of a region's servers are ejected at once (one always may be, as in Envoy):
past that, failing servers stay in rotation with their failure count, and P2C scores them down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence

from tritonclient.grpc import service_pb2

from gateway.config import HealthConfig
from gateway.errors import GatewayError
from gateway.upstream import EjectionEvent, UpstreamServer

logger = logging.getLogger(__name__)


class OutlierDetector:
    def __init__(
        self,
        cfg: HealthConfig,
        on_eject: Callable[[UpstreamServer, str], None] | None = None,
        servers: Sequence[UpstreamServer] = (),
    ) -> None:
        self.cfg = cfg
        self.on_eject = on_eject
        self.servers = servers
        self.ejections_refused = 0

    def success(self, server: UpstreamServer) -> None:
        server.consecutive_failures = 0

    def failure(self, server: UpstreamServer, reason: str, now: float) -> None:
        server.consecutive_failures += 1
        server.failures += 1
        server.last_failure_at = now
        if server.consecutive_failures >= self.cfg.eject_after_failures and not server.ejected(now):
            if self.may_eject(server, now):
                self.eject(server, reason, now)
            else:
                self.ejections_refused += 1

    def may_eject(self, server: UpstreamServer, now: float) -> bool:
        """Whether ejecting `server` keeps its region within max_ejection_percent (one always may)."""
        peers = [s for s in self.servers if s.region == server.region] or [server]
        ejected = sum(1 for s in peers if s.ejected(now))
        return ejected == 0 or (ejected + 1) * 100 <= self.cfg.max_ejection_percent * len(peers)

    def eject(self, server: UpstreamServer, reason: str, now: float) -> None:
        server.ejections += 1
        duration = min(self.cfg.max_ejection_s, self.cfg.base_ejection_s * 2 ** (server.ejections - 1))
        server.ejected_until = now + duration
        server.consecutive_failures = 0
        server.history.append(EjectionEvent(now, server.ejected_until, reason))
        logger.warning("ejected %s/%s for %.1fs: %s", server.region, server.name, duration, reason)
        if self.on_eject:
            self.on_eject(server, reason)


class HealthChecker:
    def __init__(
        self,
        servers: list[UpstreamServer],
        cfg: HealthConfig,
        protocol: str,
        detector: OutlierDetector,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.servers = servers
        self.cfg = cfg
        self.protocol = protocol
        self.detector = detector
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0

    async def probe(self, server: UpstreamServer) -> None:
        started = self.clock()
        try:
            ready, models, known = await asyncio.wait_for(self._probe(server), self.cfg.timeout_s)
        except (GatewayError, asyncio.TimeoutError, OSError, ValueError) as exc:
            was = server.healthy
            server.healthy = False
            server.last_probe_error = getattr(exc, "message", None) or f"{exc.__class__.__name__}: {exc}"
            if was:
                logger.warning(
                    "probe failed for %s/%s: %s", server.region, server.name, server.last_probe_error
                )
            return
        now = self.clock()
        server.probe_rtt.observe(now - started, now)
        if ready and not server.healthy:
            logger.info("server %s/%s is ready", server.region, server.name)
        server.healthy = ready
        server.last_probe_error = "" if ready else "server reports not ready (starting or draining)"
        server.ready_models = models
        server.known_models = known
        if (
            ready
            and not server.ejected(now)
            and server.ejections
            and now - server.ejected_until > self.cfg.max_ejection_s
        ):
            server.ejections = 0  # well-behaved for a full back-off period: start over

    async def _probe(self, server: UpstreamServer) -> tuple[bool, dict[str, set[str]], set[str]]:
        t = self.cfg.timeout_s
        if self.protocol == "grpc":
            raw = await server.grpc_call(
                "ServerReady", service_pb2.ServerReadyRequest().SerializeToString(), t
            )
            ready = service_pb2.ServerReadyResponse.FromString(raw).ready
            raw = await server.grpc_call(
                "RepositoryIndex", service_pb2.RepositoryIndexRequest().SerializeToString(), t
            )
            index = [
                (m.name, m.version, m.state)
                for m in service_pb2.RepositoryIndexResponse.FromString(raw).models
            ]
        else:
            resp = await server.http_request(b"GET", b"/v2/health/ready", b"", [], t)
            ready = resp.status == 200
            resp = await server.http_request(
                b"POST", b"/v2/repository/index", b"{}", [(b"Content-Type", b"application/json")], t
            )
            if resp.status != 200:
                raise ValueError(f"repository index answered {resp.status}")
            index = [
                (m.get("name", ""), m.get("version", ""), m.get("state", "")) for m in json.loads(resp.body)
            ]
        models: dict[str, set[str]] = {}
        known: set[str] = set()
        for name, version, state in index:
            known.add(name)
            if state == "READY" and version:
                models.setdefault(name, set()).add(version)
        return ready, models, known

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(s) for s in self.servers))
        self.rounds += 1

    async def _run(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not kill health checking for the whole fleet
                logger.exception("health round failed")
            await asyncio.sleep(max(0.0, self.cfg.interval_s - (self.clock() - started)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await asyncio.wait_for(self._task, timeout=1.0)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
            self._task = None
