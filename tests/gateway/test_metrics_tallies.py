"""The request path's tallies (gateway/operations/tallies.py) are scraped exactly as prometheus_client's
own Counter and Histogram would be after the same samples: same families, samples, labels, values."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.operations.metrics import LATENCY_BUCKETS
from gateway.operations.tallies import TallyCollector, TallyCounter, TallyHistogram

_CREATED = re.compile(rb"^(\S+_created\S*) \S+$", re.MULTILINE)

# Values on, between, below and above the bounds, and one of each label set removed again.
OBSERVED = [0.0, 0.0002, 0.00021, 0.001, 0.0015, 0.7, 10.0, 10.5, 1e9, -0.5, math.inf, math.nan]


def _created_timestamps_blanked(text: bytes) -> bytes:
    return _CREATED.sub(rb"\1 T", text)


def _play(requests: object, latency: object) -> None:
    for i, value in enumerate(OBSERVED):
        requests.labels("resnet", "eu", f"s{i % 3}", "http", "200").inc()  # type: ignore[attr-defined]
        requests.labels("bert", "us", "s1", "grpc", "503").inc(2.5)  # type: ignore[attr-defined]
        latency.labels("resnet" if i % 2 else "bert", "http").observe(value)  # type: ignore[attr-defined]
    requests.labels("resnet", "eu", "s2", "http", "200").inc(0)  # type: ignore[attr-defined]
    requests.remove("resnet", "eu", "s1", "http", "200")  # type: ignore[attr-defined]
    latency.labels("gone", "grpc").observe(0.01)  # type: ignore[attr-defined]
    latency.remove("gone", "grpc")  # type: ignore[attr-defined]


def test_tallies_are_scraped_as_prometheus_clients_own_counter_and_histogram() -> None:
    theirs = CollectorRegistry()
    their_requests = Counter(
        "t_requests_total", "Requests", ["model", "region", "server", "protocol", "status"], registry=theirs
    )
    their_latency = Histogram(
        "t_request_seconds", "Latency", ["model", "protocol"], buckets=LATENCY_BUCKETS, registry=theirs
    )
    _play(their_requests, their_latency)

    ours = CollectorRegistry()
    our_requests = TallyCounter(
        "t_requests_total", "Requests", ["model", "region", "server", "protocol", "status"]
    )
    our_latency = TallyHistogram(
        "t_request_seconds", "Latency", ["model", "protocol"], buckets=LATENCY_BUCKETS
    )
    ours.register(TallyCollector([our_requests, our_latency]))
    _play(our_requests, our_latency)

    expected = generate_latest(theirs)
    got = generate_latest(ours)
    assert b"t_requests_created" in got and b"t_request_seconds_created" in got
    assert _created_timestamps_blanked(got) == _created_timestamps_blanked(expected)


def test_a_tally_refuses_what_prometheus_client_refuses() -> None:
    counter = TallyCounter("t_total", "T", ["model"])
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("m").inc(-1)
    with pytest.raises(ValueError, match="1 label values needed"):
        counter.labels("m", "extra")
    with pytest.raises(ValueError, match="increasing order"):
        TallyHistogram("t_seconds", "T", ["model"], buckets=[1.0, 0.5])
    registry = CollectorRegistry()
    registry.register(TallyCollector([counter]))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("t_total", "T again", ["model"], registry=registry)
