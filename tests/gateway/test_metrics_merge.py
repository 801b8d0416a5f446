"""`gateway/operations/metrics_merge.py` on real prometheus_client expositions: what the ops port shows for
several workers is what one process counting every request would show."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.operations.metrics_merge import merge_expositions

BUCKETS = (0.01, 0.1, 1.0)


def _worker(requests: dict[str, int], latencies: list[float], inflight: float) -> str:
    registry = CollectorRegistry()
    counter = Counter("gw_requests", "requests", ["model"], registry=registry)
    for model, n in requests.items():
        counter.labels(model).inc(n)
    histogram = Histogram("gw_request_seconds", "latency", buckets=BUCKETS, registry=registry)
    for v in latencies:
        histogram.observe(v)
    Gauge("gw_inflight", "in flight", registry=registry).set(inflight)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_and_histograms_sum_and_gauges_keep_each_workers_view() -> None:
    a = _worker({"lt": 3, "other": 1}, [0.005, 0.05, 2.0], inflight=2)
    b = _worker({"lt": 4}, [0.05, 0.5], inflight=5)
    merged = _samples(merge_expositions({"0": a, "1": b}))
    sa, sb = _samples(a), _samples(b)

    assert merged[("gw_requests_total", (("model", "lt"),))] == 7
    assert merged[("gw_requests_total", (("model", "other"),))] == 1
    for le, want in (("0.01", 1), ("0.1", 3), ("1.0", 4), ("+Inf", 5)):  # cumulative, bucket by bucket
        assert merged[("gw_request_seconds_bucket", (("le", le),))] == want
    assert merged[("gw_request_seconds_count", ())] == 5
    # the observed values summed (they are inputs of the test, not measured times)
    assert merged[("gw_request_seconds_sum", ())] == pytest.approx(0.005 + 0.05 + 2.0 + 0.05 + 0.5)
    # `_created` is when the earliest worker started counting, not a sum of timestamps.
    created = ("gw_request_seconds_created", ())
    assert merged[created] == min(sa[created], sb[created])
    assert merged[("gw_requests_created", (("model", "lt"),))] == min(
        sa[("gw_requests_created", (("model", "lt"),))], sb[("gw_requests_created", (("model", "lt"),))]
    )
    # a gauge is one worker's view: labelled by worker, never summed
    assert merged[("gw_inflight", (("worker", "0"),))] == 2
    assert merged[("gw_inflight", (("worker", "1"),))] == 5
    assert ("gw_inflight", ()) not in merged


def test_the_merge_of_one_worker_is_that_worker_and_types_survive() -> None:
    a = _worker({"lt": 2}, [0.2], inflight=1)
    merged = merge_expositions({"0": a})
    assert {k: v for k, v in _samples(merged).items() if k[0] != "gw_inflight"} == {
        k: v for k, v in _samples(a).items() if k[0] != "gw_inflight"
    }
    types = {f.name: f.type for f in text_string_to_metric_families(merged)}
    assert types == {f.name: f.type for f in text_string_to_metric_families(a)}
    assert types["gw_requests"] == "counter" and types["gw_request_seconds"] == "histogram"
