"""The request path's counters and histograms as plain numbers, written out when Prometheus scrapes.

prometheus_client's `Counter` and `Histogram` take a lock and make several interpreted calls per
sample: counting a cache hit, its latency and its lookup cost 3.8 µs in the compiled build (about 5%
of a worker's samples on cache hits, the largest library item after the socket write); as tallies,
1.2 µs (docs/benchmarks.md, "Metrics as tallies"). A worker updates these from one thread (its event
loop) and renders /metrics on that same loop, so a sample here is an addition on a compiled object,
with nothing to lock.

What is scraped is what prometheus_client writes for the same metric: the same family, samples
and labels (`_total` and `_created`; `_bucket` with `le`, `_count`, `_sum`, `_created`), so
dashboards, alerts and the workers' merged exposition (metrics_merge.py) read them unchanged.
Children are made, cached and removed as prometheus_client's are (`labels`, `remove`).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


def _created_series() -> bool:
    # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics).
    return bool(prometheus_metrics._use_created)


class CountChild:
    """One label set of a counter."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class HistogramChild:
    """One label set of a histogram: a count per bucket (not cumulative until written out)."""

    __slots__ = ("bounds", "counts", "total", "created")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.total += value
        if value == value:  # NaN is under no bound: prometheus_client adds it to the sum only
            # prometheus_client files a value under the first bound it does not exceed (`le`).
            self.counts[bisect_left(self.bounds, value)] += 1


C = TypeVar("C", CountChild, HistogramChild)


class _Family(Generic[C]):
    """A labelled metric's children by label values, made, cached and removed as prometheus_client's are."""

    def __init__(self, kind: str, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], C] = {}

    def _new_child(self) -> C:
        raise NotImplementedError

    def _check(self, labelvalues: tuple[str, ...]) -> tuple[str, ...]:
        if len(labelvalues) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values needed, got {labelvalues!r}")
        return tuple(str(v) for v in labelvalues)

    def labels(self, *labelvalues: str) -> C:
        key = self._check(labelvalues)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self._new_child()
        return child

    def remove(self, *labelvalues: str) -> None:
        self.children.pop(self._check(labelvalues), None)


class TallyCounter(_Family[CountChild]):
    """A labelled counter whose children are `CountChild`s (`name` without its `_total`)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        super().__init__("counter", name.removesuffix("_total"), documentation, labelnames)

    def _new_child(self) -> CountChild:
        return CountChild()

    def collect(self) -> Metric:
        metric = Metric(self.name, self.documentation, self.kind)
        created = _created_series()
        for values, child in self.children.items():
            labels = dict(zip(self.labelnames, values, strict=True))
            metric.add_sample(self.name + "_total", labels, child.value)
            if created:
                metric.add_sample(self.name + "_created", labels, child.created)
        return metric


class TallyHistogram(_Family[HistogramChild]):
    """A labelled histogram whose children are `HistogramChild`s."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Iterable[float]
    ) -> None:
        super().__init__("histogram", name, documentation, labelnames)
        if "le" in self.labelnames:
            raise ValueError(f"{name}: `le` is the bucket label of a histogram, not one of its label names")
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: buckets must be in increasing order, got {bounds!r}")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(bounds) < 2:
            raise ValueError(f"{name}: a histogram needs at least one bucket below +Inf")
        self.bounds = bounds

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def collect(self) -> Metric:
        metric = Metric(self.name, self.documentation, self.kind)
        created = _created_series()
        les = [floatToGoString(b) for b in self.bounds]
        for values, child in self.children.items():
            labels = dict(zip(self.labelnames, values, strict=True))
            seen = 0.0
            for le, n in zip(les, child.counts, strict=True):
                seen += n
                metric.add_sample(self.name + "_bucket", {**labels, "le": le}, seen)
            metric.add_sample(self.name + "_count", labels, seen)
            if self.bounds[0] >= 0:  # as prometheus_client: no sum once negative values can be observed
                metric.add_sample(self.name + "_sum", labels, child.total)
            if created:
                metric.add_sample(self.name + "_created", labels, child.created)
        return metric


class TallyCollector(Collector):
    """Registers tally families with a registry, in the order given."""

    def __init__(self, families: Sequence[TallyCounter | TallyHistogram]) -> None:
        self.families = list(families)

    def describe(self) -> list[Metric]:
        return [Metric(f.name, f.documentation, f.kind) for f in self.families]

    def collect(self) -> list[Metric]:
        return [f.collect() for f in self.families]
