"""The controller's Prometheus metrics, served on its API's `/metrics` (deploy/prometheus/controller-rules.yml
alerts on them: no pass for minutes, no leader, a server with no models, loads failing repeatedly).

Everything is counted from the pass reports (controller/reconcile.py `PassReport`), so the reconcile
loop carries no metrics code of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from controller.reconcile import PassReport


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.passes = Counter("skewserve_controller_passes", "Reconcile passes finished", registry=r)
        self.pass_seconds = Histogram(
            "skewserve_controller_pass_seconds",
            "Duration of a reconcile pass",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.last_pass = Gauge(
            "skewserve_controller_last_pass_timestamp_seconds",
            "Unix time the last reconcile pass finished",
            registry=r,
        )
        self.store_errors = Counter(
            "skewserve_controller_store_errors",
            "Failed reads and writes of the model repository, by operation",
            ["op"],
            registry=r,
        )
        self.loads = Counter(
            "skewserve_controller_loads", "Model loads asked of servers, by result", ["result"], registry=r
        )
        self.unloads = Counter("skewserve_controller_unloads", "Models unloaded from servers", registry=r)
        self.unreachable = Gauge(
            "skewserve_controller_unreachable_servers", "Servers the last pass could not ask", registry=r
        )
        self.server_models = Gauge(
            "skewserve_controller_server_models",
            "Models READY on each server at the last pass",
            ["server"],
            registry=r,
        )
        self.leader = Gauge(
            "skewserve_controller_leader", "1 while this replica is the leader, else 0", registry=r
        )
        self._servers: set[str] = set()

    def observe(self, report: PassReport, seconds: float) -> None:
        self.passes.inc()
        self.pass_seconds.observe(seconds)
        self.last_pass.set(time.time())
        for op, count in report.store_errors.items():
            self.store_errors.labels(op=op).inc(count)
        self.loads.labels(result="loaded").inc(len(report.loads))
        self.loads.labels(result="failed").inc(report.failed_loads)
        self.unloads.inc(len(report.unloads))
        self.unreachable.set(len(report.unreachable))
        held = {server: len(models) for server, models in report.held.items()}
        for gone in self._servers - set(held):  # a server gone from discovery is no longer a series
            self.server_models.remove(gone)
        for server, count in held.items():
            self.server_models.labels(server=server).set(count)
        self._servers = set(held)

    def track_failed_passes(self, count: Callable[[], int]) -> None:
        Gauge(
            "skewserve_controller_failed_passes",
            "Reconcile passes that raised since the process started (retried next interval)",
            registry=self.registry,
        ).set_function(count)

    def follow_leader(self, leading: Callable[[], bool]) -> None:
        """The leader gauge reads the election when scraped: a replica stops leading by its own clock
        (its renewal stalled on storage) between two attempts, and must say so at once."""
        self.leader.set_function(lambda: 1.0 if leading() else 0.0)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
