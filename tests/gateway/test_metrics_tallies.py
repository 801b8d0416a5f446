"""The request path's tallies (gateway/operations/tallies.py) are scraped exactly as prometheus_client's
own Counter and Histogram would be after the same samples: same families, samples, labels, values."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from gateway.operations.metrics import LATENCY_BUCKETS
from gateway.operations.tallies import TallyCollector, TallyCounter, TallyHistogram

_CREATED = re.compile(rb"^([a-z_]+_created(?:\{.*\})?) \S+$", re.MULTILINE)

# Values on, between, below and above the bounds, and one of each label set removed again.
OBSERVED = [0.0, 0.0002, 0.00021, 0.001, 0.0015, 0.7, 10.0, 10.5, 1e9, -0.5, math.inf, math.nan]
ODD_LABEL = 'a "quoted" back\\slash\nnew line, é'


def _created_timestamps_blanked(text: bytes) -> bytes:
    return _CREATED.sub(rb"\1 T", text)


def _play(requests: object, latency: object, signed: object) -> None:
    for i, value in enumerate(OBSERVED):
        requests.labels("resnet", "eu", f"s{i % 3}", "http", "200").inc()  # type: ignore[attr-defined]
        requests.labels(ODD_LABEL, "", "s1", "http", "200").inc()  # type: ignore[attr-defined]
        signed.labels("m").observe(value)  # type: ignore[attr-defined]
        requests.labels("bert", "us", "s1", "grpc", "503").inc(2.5)  # type: ignore[attr-defined]
        latency.labels("resnet" if i % 2 else "bert", "http").observe(value)  # type: ignore[attr-defined]
    requests.labels("resnet", "eu", "s2", "http", "200").inc(0)  # type: ignore[attr-defined]
    requests.remove("resnet", "eu", "s1", "http", "200")  # type: ignore[attr-defined]
    latency.labels("gone", "grpc").observe(0.01)  # type: ignore[attr-defined]
    latency.remove("gone", "grpc")  # type: ignore[attr-defined]


@pytest.mark.parametrize("created", [True, False], ids=["created", "PROMETHEUS_DISABLE_CREATED_SERIES"])
def test_tallies_are_scraped_as_prometheus_clients_own_counter_and_histogram(
    created: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prometheus_metrics, "_use_created", created)
    theirs = CollectorRegistry()
    their_requests = Counter(
        "t_requests_total", "Requests", ["model", "region", "server", "protocol", "status"], registry=theirs
    )
    their_latency = Histogram(
        "t_request_seconds", "Latency", ["model", "protocol"], buckets=LATENCY_BUCKETS, registry=theirs
    )
    # Bounds below zero: prometheus_client writes no `_sum` then.
    their_signed = Histogram("t_signed", "Signed", ["model"], buckets=[-1.0, 0.0, 1.0], registry=theirs)
    _play(their_requests, their_latency, their_signed)

    ours = CollectorRegistry()
    our_requests = TallyCounter(
        "t_requests_total", "Requests", ["model", "region", "server", "protocol", "status"]
    )
    our_latency = TallyHistogram(
        "t_request_seconds", "Latency", ["model", "protocol"], buckets=LATENCY_BUCKETS
    )
    our_signed = TallyHistogram("t_signed", "Signed", ["model"], buckets=[-1.0, 0.0, 1.0])
    ours.register(TallyCollector([our_requests, our_latency, our_signed]))
    _play(our_requests, our_latency, our_signed)

    expected = generate_latest(theirs)
    got = generate_latest(ours)
    assert (b"t_requests_created" in got and b"t_request_seconds_created" in got) == created
    assert b"t_signed_sum" not in got and b"t_request_seconds_sum" in got
    assert _created_timestamps_blanked(got) == _created_timestamps_blanked(expected)


def test_a_tally_refuses_the_amounts_labels_and_buckets_prometheus_client_refuses() -> None:
    counter = TallyCounter("t_total", "T", ["model"])
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("m").inc(-1)
    with pytest.raises(ValueError, match="1 label values needed"):
        counter.labels("m", "extra")
    with pytest.raises(ValueError, match="increasing order"):
        TallyHistogram("t_seconds", "T", ["model"], buckets=[1.0, 0.5])
    with pytest.raises(ValueError, match="at least one bucket"):
        TallyHistogram("t_seconds", "T", ["model"], buckets=[math.inf])
    with pytest.raises(ValueError, match="`le` is the bucket label"):
        TallyHistogram("t_seconds", "T", ["le"], buckets=LATENCY_BUCKETS)
    registry = CollectorRegistry()
    registry.register(TallyCollector([counter]))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("t_total", "T again", ["model"], registry=registry)
