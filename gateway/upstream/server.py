"""Upstream Triton servers: one object per server holding its connections and its observed state.

Every call to a Triton server, HTTP or gRPC, goes through `UpstreamServer` so that routing,
retries, health and caching see one interface and one error tree whatever carried the bytes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gateway.config import ServerConfig
from gateway.upstream.grpc_over_http import HttpBinaryChannel
from gateway.upstream.grpc_relay import GrpcChannel, GrpcRelay, RelayChannel, StreamChannel
from gateway.upstream.http_client import HttpPool, HttpResponse
from gateway.upstream.tls import UpstreamTls

Clock = Callable[[], float]


class ChangeCount:
    """A count of changes that what routing keeps between requests depends on: it is rebuilt when
    the count has moved since, so a request reads it instead of walking every server. One count per
    process: a change in one gateway rebuilds another's in the same process too, which costs only
    that."""

    def __init__(self) -> None:
        self.count = 0

    def bump(self) -> None:
        self.count += 1


# What a server holds, which servers and regions there are, a region's fixed RTT, the home region:
# routing's model index (gateway/fleet/model_index.py) and its region order.
FLEET_CHANGES: Final = ChangeCount()
# Probes' round-trip samples: the nearest-region order (a region's RTT is its servers' minimum).
PROBE_RTT_SAMPLES: Final = ChangeCount()


@dataclass
class EjectionEvent:
    at: float
    until: float
    reason: str

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "seconds_ago": round(now - self.at, 3),
            "ejected_for_s": round(self.until - self.at, 3),
            "reason": self.reason,
        }


class LatencyStats:
    """Time-decayed EWMA of latency and its deviation (Finagle's decaying EWMA; p95 ≈ mean + 1.645 sd)."""

    __slots__ = ("decay_s", "mean", "var", "last", "samples")

    def __init__(self, decay_s: float) -> None:
        self.decay_s = decay_s
        self.mean = 0.0
        self.var = 0.0
        self.last = 0.0
        self.samples = 0

    def observe(self, seconds: float, now: float) -> None:
        if self.samples == 0:
            self.mean, self.var = seconds, 0.0
        else:
            w = math.exp(-max(0.0, now - self.last) / self.decay_s)
            w = min(w, 0.9)  # a burst of samples in the same instant still moves the average
            diff = seconds - self.mean
            self.mean += (1 - w) * diff
            self.var = w * (self.var + (1 - w) * diff * diff)
        self.last = now
        self.samples += 1

    def p95(self) -> float:
        return self.mean + 1.645 * math.sqrt(max(self.var, 0.0))


class ProbeRtt(LatencyStats):
    """A server's probe round-trip times: each sample may reorder the nearest regions."""

    __slots__ = ()

    def observe(self, seconds: float, now: float) -> None:
        super().observe(seconds, now)
        PROBE_RTT_SAMPLES.bump()


class UpstreamServer:
    def __init__(
        self,
        cfg: ServerConfig,
        region: str,
        decay_s: float,
        connect_timeout_s: float,
        clock: Clock = time.monotonic,
        grpc_relay: GrpcRelay | None = None,
        tls: UpstreamTls | None = None,
        grpc_over_http: bool = False,
    ) -> None:
        self.name = cfg.name
        self.region = region
        self.http_address = cfg.http
        self.grpc_address = cfg.grpc
        self.http = HttpPool(cfg.http, connect_timeout_s=connect_timeout_s, tls=tls)
        channel = grpc_relay.channel(cfg.grpc) if grpc_relay is not None else GrpcChannel(cfg.grpc, tls)
        # listen.grpc_upstream http_binary: ModelInfer to the HTTP port where that is exact
        self.grpc: GrpcChannel | RelayChannel | HttpBinaryChannel = (
            HttpBinaryChannel(self.http, channel) if grpc_over_http else channel
        )
        self.streams = StreamChannel(cfg.grpc, tls)  # ModelStreamInfer: always direct, never relayed
        self.clock = clock
        self.latency = LatencyStats(decay_s)
        self.probe_rtt = ProbeRtt(decay_s * 5)
        self.inflight = 0
        # Streams held open on this server: shown, never counted as load (an idle stream held by a
        # client would otherwise mark the server saturated for everyone's requests).
        self.open_streams = 0
        self.healthy = False  # until the first probe says ready
        self.last_probe_error = "not probed yet"
        # Read through the properties below; changed only by assigning them or through
        # forget_model / forget_version, which count the change for routing's model index.
        self._ready_models: dict[str, set[str]] = {}
        self._known_models: frozenset[str] = frozenset()
        self.consecutive_failures = 0
        self.last_failure_at = 0.0
        self.ejections = 0
        self.ejected_until = 0.0
        self.history: deque[EjectionEvent] = deque(maxlen=20)
        self.requests = 0
        self.failures = 0

    # -- state --------------------------------------------------------------------------------
    @property
    def ready_models(self) -> Mapping[str, set[str]]:
        """Model -> versions ready here, as last probed. Read-only: assign a new mapping or use
        forget_model / forget_version, or routing's index will not see the change."""
        return self._ready_models

    @ready_models.setter
    def ready_models(self, models: Mapping[str, set[str]]) -> None:
        # A copy: a caller changing its own mapping afterwards does not change this server unseen.
        copy = {model: set(versions) for model, versions in models.items()}
        if copy != self._ready_models:  # a probe that finds nothing new rebuilds nothing
            FLEET_CHANGES.bump()
        self._ready_models = copy

    @property
    def known_models(self) -> frozenset[str]:
        """Every model ever probed loaded here (a model unloading for a moment is not unknown)."""
        return self._known_models

    @known_models.setter
    def known_models(self, models: Collection[str]) -> None:
        known = frozenset(models)
        if known != self._known_models:
            FLEET_CHANGES.bump()
        self._known_models = known

    def forget_model(self, model: str) -> None:
        """The model is gone from here (Triton said so) until a probe lists it again."""
        if self._ready_models.pop(model, None) is not None:
            FLEET_CHANGES.bump()

    def forget_version(self, model: str, version: str) -> None:
        versions = self._ready_models.get(model)
        if versions is None:
            return
        if version in versions:
            versions.discard(version)
            FLEET_CHANGES.bump()
        if not versions:
            self._ready_models.pop(model, None)

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def has_model(self, model: str, version: str) -> bool:
        versions = self._ready_models.get(model)
        return bool(versions) and (not version or version in versions)  # type: ignore[operator]

    def score(self) -> float:
        """Lower is better: expected wait if we add one more request (latency x queue), doubled per
        consecutive failure (errors never enter the latency average), so a server that fails fast
        soon looks worse than any slow server that answers."""
        base = self.latency.mean if self.latency.samples else 1e-3
        score = base * (self.inflight + 1)
        # Only recent failures weigh: a server left alone after failing gets traffic again later,
        # rather than waiting forever for the success that would clear its count.
        if self.consecutive_failures and self.clock() - self.last_failure_at < 5 * self.latency.decay_s:
            score *= 2.0 ** min(self.consecutive_failures, 30)
        return score

    # -- calls --------------------------------------------------------------------------------
    async def http_request(
        self, method: bytes, path: bytes, body: bytes, headers: list[tuple[bytes, bytes]], timeout_s: float
    ) -> HttpResponse:
        return await self.http.request(method, path, body, headers, timeout_s)

    async def grpc_call(
        self, method: str, request: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]] = ()
    ) -> bytes:
        return await self.grpc.call(method, request, timeout_s, metadata)

    async def close(self) -> None:
        await self.http.close()
        await self.grpc.close()
        await self.streams.close()

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "region": self.region,
            "http": self.http_address,
            "grpc": self.grpc_address,
            "healthy": self.healthy,
            "ejected": self.ejected(now),
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3),
            "available": self.available(now),
            "inflight": self.inflight,
            "open_streams": self.open_streams,
            "ewma_latency_ms": round(self.latency.mean * 1000, 3),
            "p95_latency_ms": round(self.latency.p95() * 1000, 3),
            "latency_samples": self.latency.samples,
            "probe_rtt_ms": round(self.probe_rtt.mean * 1000, 3),
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.ejections,
            "ejection_history": [e.as_dict(now) for e in self.history],
            "models": {
                m: sorted(v, key=lambda x: int(x) if x.isdigit() else 0)
                for m, v in sorted(self.ready_models.items())
            },
            "last_probe_error": self.last_probe_error,
            "requests": self.requests,
            "failures": self.failures,
            **({"grpc_over_http": self.grpc.describe()} if isinstance(self.grpc, HttpBinaryChannel) else {}),
        }
