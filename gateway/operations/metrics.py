"""Prometheus metrics for the gateway, on a private registry served at /metrics.

Hot-path counters use pre-bound label children cached in dicts (a `.labels()` lookup per request
costs more than the increment). Gauges that describe the fleet (in-flight per server, skew index
per region, cache bytes) are computed when Prometheus scrapes, not on every request.

Label values are bounded whatever clients send: a `model` label is the model's name only when some
server has reported it loaded and the caller was admitted to it (see `Gateway.model_label`);
every other name folds into `OTHER_MODEL`, so invented names cannot grow /metrics or the child cache.
Cascade labels are bounded the same way: cascade and stage names come from the config, classes
from the deferral rule's file (the first stage model's classes), never from a request.
Server labels are bounded as the fleet churns (discovered pods come and go with new addresses): the
gateway reports each server joining and leaving, a departed server's label children are removed, and
a request that finishes on it after that counts under `DEPARTED_SERVER`.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway import compiled_build
from gateway.operations.tallies import (
    CountChild,
    HistogramChild,
    TallyCollector,
    TallyCounter,
    TallyHistogram,
)

OTHER_MODEL: Final = "__other__"
DEPARTED_SERVER: Final = "__departed__"
LATENCY_BUCKETS: Final = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class _FleetCollector(Collector):
    def __init__(self, describe: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = describe

    def collect(self) -> Iterable[GaugeMetricFamily]:
        state = self._snapshot()
        inflight = GaugeMetricFamily(
            "skewserve_gateway_upstream_inflight",
            "Requests in flight per upstream server",
            labels=["region", "server"],
        )
        available = GaugeMetricFamily(
            "skewserve_gateway_upstream_available",
            "1 when the server is healthy and not ejected",
            labels=["region", "server"],
        )
        ewma = GaugeMetricFamily(
            "skewserve_gateway_upstream_ewma_latency_seconds",
            "EWMA upstream latency",
            labels=["region", "server"],
        )
        for s in state["servers"]:
            inflight.add_metric([s["region"], s["name"]], s["inflight"])
            available.add_metric([s["region"], s["name"]], 1.0 if s["available"] else 0.0)
            ewma.add_metric([s["region"], s["name"]], s["ewma_latency_ms"] / 1000)
        skew = GaugeMetricFamily(
            "skewserve_gateway_region_skew_index",
            "max/mean in-flight across a region's servers",
            labels=["region"],
        )
        for region, value in state["skew_index"].items():
            skew.add_metric([region], value)
        total = GaugeMetricFamily("skewserve_gateway_inflight", "Requests in flight through the gateway")
        total.add_metric([], state["inflight"])
        cache_bytes = GaugeMetricFamily(
            "skewserve_gateway_cache_bytes", "Bytes held by the in-process response cache"
        )
        cache_bytes.add_metric([], state["cache_bytes"])
        yield from (inflight, available, ewma, skew, total, cache_bytes)
        redis_state = state.get("redis")
        if redis_state is not None:
            breaker = GaugeMetricFamily(
                "skewserve_gateway_redis_breaker_open",
                "1 while the Redis circuit breaker is open (cache and shared limits fail open to Triton / local buckets)",
            )
            breaker.add_metric([], 0.0 if redis_state["breaker"] == "closed" else 1.0)
            queue = GaugeMetricFamily(
                "skewserve_gateway_redis_write_queue", "Cache writes waiting for the background Redis writer"
            )
            queue.add_metric([], redis_state["write_queue"])
            yield from (breaker, queue)


class _StepCollector(Collector):
    def __init__(self, costs: Any) -> None:
        self._costs = costs

    def collect(self) -> Iterable[CounterMetricFamily]:
        seconds = CounterMetricFamily(
            "skewserve_gateway_step_seconds",
            "Wall time spent in each step of the request pipeline (step_timing: true)",
            labels=["step"],
        )
        calls = CounterMetricFamily(
            "skewserve_gateway_step_calls",
            "Times each pipeline step ran (step_timing: true)",
            labels=["step"],
        )
        for step, total in sorted(self._costs.seconds.items()):
            seconds.add_metric([step], total)
            calls.add_metric([step], self._costs.calls.get(step, 0))
        yield seconds
        yield calls


class _TrafficCollector(Collector):
    """Canary and shadow tallies (gateway/fleet/traffic.py), read at scrape time; they count from a
    canary's start, so a new canary resets them (Prometheus reads that as a counter reset)."""

    def __init__(self, plans: Callable[[], dict[str, Any]]) -> None:
        self._plans = plans

    def collect(self) -> Iterable[CounterMetricFamily]:
        answers = CounterMetricFamily(
            "skewserve_gateway_traffic_answers",
            "Answers of models in canary by version and role (stable, canary, shadow)",
            labels=["model", "version", "role", "outcome"],
        )
        shadow = CounterMetricFamily(
            "skewserve_gateway_shadow_answers",
            "Mirrored answers by class of the stable answer and outcome (agree, disagree, error)",
            labels=["model", "version", "class", "outcome"],
        )
        seen = CounterMetricFamily(
            "skewserve_gateway_shadow_class_seen",
            "Stable answers of models in shadow by class",
            labels=["model", "version", "class"],
        )
        skipped = CounterMetricFamily(
            "skewserve_gateway_shadow_skipped",
            "Requests left unmirrored (shadow busy or request too large)",
            labels=["model", "version"],
        )
        for model, plan in self._plans().items():
            for role, t in plan.tally.roles.items():
                version = plan.stable if role == "stable" else plan.canary
                answers.add_metric([model, version, role, "ok"], t.requests - t.errors)
                answers.add_metric([model, version, role, "error"], t.errors)
            for cls, c in plan.tally.classes.items():
                seen.add_metric([model, plan.canary, cls], c.seen)
                for outcome in ("agree", "disagree", "error"):
                    shadow.add_metric([model, plan.canary, cls, outcome], getattr(c, outcome))
            skipped.add_metric([model, plan.canary], plan.tally.skipped)
        yield from (answers, shadow, seen, skipped)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge(
            "skewserve_gateway_build_info",
            "The build of the request path this process runs: compiled (mypyc) or pure (the Python sources)",
            ["build"],
            registry=r,
        ).labels(compiled_build.active()).set(1)
        # The four metrics every request updates are tallies (gateway/operations/tallies.py).
        self._requests = TallyCounter(
            "skewserve_gateway_requests_total",
            "Requests by model, region, server, protocol and status",
            ["model", "region", "server", "protocol", "status"],
        )
        self._latency = TallyHistogram(
            "skewserve_gateway_request_seconds",
            "End-to-end gateway latency",
            ["model", "protocol"],
            buckets=LATENCY_BUCKETS,
        )
        self._upstream = TallyHistogram(
            "skewserve_gateway_upstream_seconds",
            "Upstream call latency",
            ["region", "server"],
            buckets=LATENCY_BUCKETS,
        )
        self._cache = TallyCounter(
            "skewserve_gateway_cache_requests_total", "Cache lookups", ["model", "result"]
        )
        r.register(TallyCollector([self._requests, self._latency, self._upstream, self._cache]))
        self._cache_bytes = Counter(
            "skewserve_gateway_cache_stored_bytes_total", "Bytes written to the cache", ["model"], registry=r
        )
        self.cache_evictions = Counter(
            "skewserve_gateway_cache_evictions_total", "In-process cache evictions", registry=r
        )
        self.cache_tampered = Counter(
            "skewserve_gateway_cache_integrity_failures_total",
            "Redis entries failing the HMAC check",
            registry=r,
        )
        self.coalesced = Counter(
            "skewserve_gateway_coalesced_requests_total",
            "Requests that shared another's upstream call",
            ["model"],
            registry=r,
        )
        self._retries = Counter(
            "skewserve_gateway_retries_total", "Retries on another server", ["model"], registry=r
        )
        self._hedges = Counter(
            "skewserve_gateway_hedges_total", "Hedged second requests", ["model"], registry=r
        )
        self.budget_exhausted = Counter(
            "skewserve_gateway_retry_budget_exhausted_total", "Retries refused by the budget", registry=r
        )
        self._ejections = Counter(
            "skewserve_gateway_ejections_total", "Outlier ejections", ["region", "server"], registry=r
        )
        self._spillovers = Counter(
            "skewserve_gateway_spillovers_total",
            "Requests sent outside the home region",
            ["from_region", "to_region"],
            registry=r,
        )
        self.shed = Counter(
            "skewserve_gateway_shed_total", "Requests refused by admission", ["reason"], registry=r
        )
        self.redis_breaker_opened = Counter(
            "skewserve_gateway_redis_breaker_opened_total",
            "Times the Redis circuit breaker opened",
            registry=r,
        )
        self.redis_writes_dropped = Counter(
            "skewserve_gateway_redis_writes_dropped_total",
            "Cache writes dropped because the background writer's queue was full or Redis was down",
            registry=r,
        )
        self.rate_limited = Counter(
            "skewserve_gateway_rate_limited_total",
            "Requests refused by a rate limit, by where the bucket lived",
            ["scope", "store"],
            registry=r,
        )
        # Cascades (gateway/pipeline/cascade.py; docs/cascade.md#metrics).
        self._cascade_answers = Counter(
            "skewserve_gateway_cascade_answers_total",
            "Cascade answers by the stage that gave them (offline: a later stage should have answered and could not)",
            ["cascade", "stage", "offline"],
            registry=r,
        )
        self._cascade_judged = Counter(
            "skewserve_gateway_cascade_judged_items_total",
            "Items a stage's deferral rule judged, by the stage's predicted class",
            ["cascade", "stage", "class"],
            registry=r,
        )
        self._cascade_escalations = Counter(
            "skewserve_gateway_cascade_escalations_total",
            "Items a stage's deferral rule sent on to the next stage, by the stage's predicted class",
            ["cascade", "stage", "class"],
            registry=r,
        )
        self._cascade_failures = Counter(
            "skewserve_gateway_cascade_stage_failures_total",
            "Stage calls that gave no answer (no server, an error, the stage deadline): the request went on",
            ["cascade", "stage"],
            registry=r,
        )
        self._cascade_bytes = Counter(
            "skewserve_gateway_cascade_upstream_bytes_total",
            "Request bytes sent (or attempted) to each stage after the first",
            ["cascade", "stage"],
            registry=r,
        )
        self._cascade_latency = Histogram(
            "skewserve_gateway_cascade_stage_seconds",
            "Time each cascade stage took, by outcome (answer, failure)",
            ["cascade", "stage", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Folds client-chosen model names into a bounded set; the gateway installs the real rule.
        self.model_label: Callable[[str], str] = lambda model: model
        self._children: dict[tuple[Any, ...], Any] = {}
        # Each request's two children by its labels as given: one lookup and two native calls per
        # request (by metric and final labels, each child cost a tuple built and a lookup). Dropped
        # for a server whenever it joins or leaves, so its requests fold as `_server_label` says.
        self._request_children: dict[tuple[str, str, str, str, str], tuple[CountChild, HistogramChild]] = {}
        # Servers in the fleet (a name can be held twice while an old server drains and a new one
        # with its name joins), and where each per-server metric keeps its region and server labels.
        self._fleet: Tally[tuple[str, str]] = Tally()
        self._per_server: dict[int, tuple[Any, int, int]] = {
            id(self._requests): (self._requests, 1, 2),
            id(self._upstream): (self._upstream, 0, 1),
            id(self._ejections): (self._ejections, 0, 1),
        }

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def server_joined(self, region: str, server: str) -> None:
        self._fleet[(region, server)] += 1
        self._forget_request_children(region, server)  # they may count under DEPARTED_SERVER

    def server_left(self, region: str, server: str) -> None:
        """Forget a departed server's label children, unless another server of its name is in the fleet."""
        self._fleet[(region, server)] -= 1
        if self._fleet[(region, server)] > 0:
            return
        del self._fleet[(region, server)]
        self._forget_request_children(region, server)
        for key in [k for k in self._children if k[0] in self._per_server]:
            metric, region_at, server_at = self._per_server[key[0]]
            labels = key[1:]
            if labels[region_at] == region and labels[server_at] == server:
                del self._children[key]
                metric.remove(*labels)

    def _server_label(self, region: str, server: str) -> str:
        """`server` while it is in the fleet (or no server was reached), else DEPARTED_SERVER."""
        return server if not server or (region, server) in self._fleet else DEPARTED_SERVER

    def _forget_request_children(self, region: str, server: str) -> None:
        for key in [k for k in self._request_children if k[1] == region and k[2] == server]:
            del self._request_children[key]

    def request(
        self, model: str, region: str, server: str, protocol: str, status: str, seconds: float
    ) -> None:
        model = self.model_label(model)
        key = (model, region, server, protocol, status)
        children = self._request_children.get(key)
        if children is None:  # a new label set: checked once, then cached (the hot path is the lookup)
            label = self._server_label(region, server)
            children = (
                self._child(self._requests, model, region, label, protocol, status),
                self._child(self._latency, model, protocol),
            )
            # A departed server's late requests are not remembered by its name: names come and go
            # with discovery, and nothing would drop them.
            if label == server:
                self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def upstream_latency(self, server: Any, seconds: float) -> None:
        region = server.region
        name = self._server_label(region, server.name)
        child: HistogramChild = self._child(self._upstream, region, name)  # typed: a native call
        child.observe(seconds)

    def cache(self, model: str, hit: bool) -> None:
        child: CountChild = self._child(self._cache, self.model_label(model), "hit" if hit else "miss")
        child.inc()

    def cache_stored(self, model: str, n: int) -> None:
        self._child(self._cache_bytes, self.model_label(model)).inc(n)

    def coalesced_request(self, model: str) -> None:
        self._child(self.coalesced, self.model_label(model)).inc()

    def retry(self, model: str) -> None:
        self._child(self._retries, self.model_label(model)).inc()

    def hedge(self, model: str) -> None:
        self._child(self._hedges, self.model_label(model)).inc()

    def cascade_stage(
        self, cascade: str, stage: str, seconds: float, answered: bool, sent_bytes: int | None
    ) -> None:
        """One stage call of a cascade: its time, and the request's bytes when sent on (a later stage)."""
        self._child(self._cascade_latency, cascade, stage, "answer" if answered else "failure").observe(
            seconds
        )
        if not answered:
            self._child(self._cascade_failures, cascade, stage).inc()
        if sent_bytes is not None:
            self._child(self._cascade_bytes, cascade, stage).inc(sent_bytes)

    def cascade_judged(self, cascade: str, stage: str, classes: Iterable[str], escalated: bool) -> None:
        """A rule's verdict on one answer: each item's predicted class, and whether it went on."""
        for cls in classes:
            self._child(self._cascade_judged, cascade, stage, cls).inc()
            if escalated:
                self._child(self._cascade_escalations, cascade, stage, cls).inc()

    def cascade_answer(self, cascade: str, stage: str, offline: bool) -> None:
        self._child(self._cascade_answers, cascade, stage, "true" if offline else "false").inc()

    def limited(self, scope: str, store: str) -> None:
        self._child(self.rate_limited, scope, store).inc()

    def retry_budget_exhausted(self) -> None:
        self.budget_exhausted.inc()

    def ejection(self, server: Any, reason: str) -> None:
        self._child(self._ejections, server.region, self._server_label(server.region, server.name)).inc()

    def spillover(self, home: str, region: str) -> None:
        self._child(self._spillovers, home, region).inc()

    def attach_fleet(self, describe: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_FleetCollector(describe))

    def attach_traffic(self, plans: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_TrafficCollector(plans))

    def attach_step_costs(self, costs: Any) -> None:
        """Per-step time of the request pipeline (`step_timing: true`; gateway/operations/step_costs.py)."""
        self.registry.register(_StepCollector(costs))

    def render(self) -> bytes:
        return generate_latest(self.registry)
