"""Active health probes and passive outlier ejection.

Active: every interval each server is asked whether it is ready and which model versions are
ready, over gRPC or HTTP. The versions come from Triton's statistics API, which answers from the
server's memory: the repository index would list the repository (on `s3://`, the bucket, once more
per model) every second per worker, and it is closed to all but the controller
(`--http-restricted-api=model-repository:...`). A draining server (not ready) or one where a model is
not (yet) loaded gets no requests for that model; servers run with `--strict-readiness=false`, so a
version loading on a server does not take its other models out of rotation. Passive: consecutive failures or timeouts on real
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
from gateway.task_stop import cancel_and_wait
from gateway.upstream.server import EjectionEvent, UpstreamServer

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


_PARSE_ON_LOOP_BYTES = 64 * 1024  # larger answers (hundreds of models) are parsed off the event loop


def _grpc_loaded(raw: bytes) -> list[tuple[str, str]]:
    return [(m.name, m.version) for m in service_pb2.ModelStatisticsResponse.FromString(raw).model_stats]


def _http_loaded(body: bytes) -> list[tuple[str, str]]:
    return [
        (str(m.get("name", "")), str(m.get("version", ""))) for m in json.loads(body).get("model_stats", [])
    ]


async def _off_loop_if_large(
    body: bytes, parse: Callable[[bytes], list[tuple[str, str]]]
) -> list[tuple[str, str]]:
    if len(body) > _PARSE_ON_LOOP_BYTES:
        return await asyncio.to_thread(parse, body)
    return parse(body)


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
        self._round: asyncio.Event | None = None
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

    async def _probe(self, server: UpstreamServer) -> tuple[bool, dict[str, set[str]], frozenset[str]]:
        t = self.cfg.timeout_s
        if self.protocol == "grpc":
            raw = await server.grpc_call(
                "ServerReady", service_pb2.ServerReadyRequest().SerializeToString(), t
            )
            ready = service_pb2.ServerReadyResponse.FromString(raw).ready
            raw = await server.grpc_call(
                "ModelStatistics", service_pb2.ModelStatisticsRequest().SerializeToString(), t
            )
            loaded = await _off_loop_if_large(raw, _grpc_loaded)
        else:
            resp = await server.http_request(b"GET", b"/v2/health/ready", b"", [], t)
            ready = resp.status == 200
            resp = await server.http_request(b"GET", b"/v2/models/stats", b"", [], t)
            if resp.status != 200:
                raise ValueError(f"model statistics answered {resp.status}")
            loaded = await _off_loop_if_large(resp.body, _http_loaded)
        models: dict[str, set[str]] = {}
        for name, version in loaded:
            if version:
                models.setdefault(name, set()).add(version)
        # Known: ever seen loaded here, so a model unloading for a moment is "not ready", not unknown.
        return ready, models, server.known_models | set(models)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(s) for s in self.servers))
        self.rounds += 1
        if self._round is not None:
            self._round.set()
            self._round = None

    async def next_round(self, timeout_s: float) -> None:
        """Return after the next probe round (or `timeout_s`): what servers hold was read again."""
        if self._round is None:
            self._round = asyncio.Event()
        try:
            await asyncio.wait_for(self._round.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

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
            await cancel_and_wait(self._task)
            self._task = None
