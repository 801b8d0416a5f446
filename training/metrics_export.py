"""Live Prometheus metrics of a training run: one HTTP endpoint per rank, on base port + rank.

Switched on by `SKEWSERVE_TRAIN_METRICS_PORT=<base>` (torchrun passes the environment to every rank;
`skewserve train --metrics-port` sets it). Each rank serves its own registry on
`SKEWSERVE_TRAIN_METRICS_HOST` (default 127.0.0.1):<base + local rank>, so Prometheus scrapes each
rank where it runs, and a rank that stalls shows as a flat series rather than hiding in a sum.

Series (label `rank`; counters, so Prometheus computes rates and the imbalance over any window):
  skewserve_train_steps_total, skewserve_train_samples_total,
  skewserve_train_busy_seconds_total (compute + data wait: the monitor's busy time),
  skewserve_train_data_wait_seconds_total, skewserve_train_allreduce_wait_seconds_total,
  gauges skewserve_train_samples_per_second (last step), skewserve_train_grad_norm (last step,
  before clipping), skewserve_train_epoch, skewserve_train_epoch_imbalance_ratio (max/mean busy
  time of the last finished epoch, from all ranks), skewserve_train_gpu_utilization (CUDA only).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from training.step_record import StepRecord

logger = logging.getLogger(__name__)

PORT_ENV = "SKEWSERVE_TRAIN_METRICS_PORT"
HOST_ENV = "SKEWSERVE_TRAIN_METRICS_HOST"


def rank_port(base: int, local_rank: int) -> int:
    return base + local_rank


class RankMetrics:
    """One rank's metrics and the HTTP server exposing them."""

    def __init__(self, rank: int, host: str, port: int) -> None:
        self.rank = str(rank)
        self.registry = CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["rank"], registry=r).labels(self.rank)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            g = Gauge(name, doc, ["rank", *extra], registry=r)
            return g if extra else g.labels(self.rank)

        self.steps = counter("skewserve_train_steps", "optimizer steps taken by this rank")
        self.samples = counter("skewserve_train_samples", "training samples processed by this rank")
        self.busy = counter("skewserve_train_busy_seconds", "compute plus data-wait time of this rank")
        self.data_wait = counter("skewserve_train_data_wait_seconds", "time waiting for the next batch")
        self.allreduce_wait = counter(
            "skewserve_train_allreduce_wait_seconds",
            "time waiting in the gradient all-reduce for other ranks",
        )
        self.throughput = gauge("skewserve_train_samples_per_second", "samples/s of the last step")
        self.grad_norm = gauge("skewserve_train_grad_norm", "global gradient L2 norm of the last step")
        self.epoch = gauge("skewserve_train_epoch", "epoch in progress")
        self.imbalance = gauge(
            "skewserve_train_epoch_imbalance_ratio", "max/mean per-rank busy time of the last finished epoch"
        )
        self.gpu = gauge("skewserve_train_gpu_utilization", "GPU busy fraction (CUDA only)", ("device",))
        self.server, self.thread = start_http_server(port, addr=host, registry=r)
        self.address = f"{host}:{port}"
        logger.info("rank %s serves training metrics on http://%s/metrics", self.rank, self.address)

    def step(self, rec: StepRecord) -> None:
        self.steps.inc()
        self.samples.inc(rec.samples)
        self.busy.inc(rec.compute_s + rec.data_wait_s)
        self.data_wait.inc(rec.data_wait_s)
        self.allreduce_wait.inc(rec.allreduce_wait_s)
        self.throughput.set(rec.samples_per_s)
        self.epoch.set(rec.epoch)
        self._gpu()

    def gradient_norm(self, value: float) -> None:
        self.grad_norm.set(value)

    def finished_epoch(self, summary: dict[str, Any]) -> None:
        self.imbalance.set(float(summary["imbalance_ratio"]))

    def _gpu(self) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        device = torch.cuda.current_device()
        try:
            busy = torch.cuda.utilization(device) / 100.0  # NVML through pynvml
        except Exception:  # no NVML in this environment: the series is absent, training goes on
            return
        self.gpu.labels(self.rank, str(device)).set(busy)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def rank_exporter(rank: int) -> RankMetrics | None:
    """The rank's exporter when SKEWSERVE_TRAIN_METRICS_PORT is set, else None (nothing served)."""
    base = os.environ.get(PORT_ENV)
    if not base:
        return None
    if not base.isdigit() or not 0 < int(base) < 65536:
        raise ValueError(
            f"{PORT_ENV}={base!r} is not a port number; set it to e.g. 9400 (rank r serves 9400+r)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    host = os.environ.get(HOST_ENV, "127.0.0.1")
    return RankMetrics(rank, host, rank_port(int(base), local_rank))
