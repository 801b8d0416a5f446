"""The placement benchmark's trace, small: locust through the real gateway onto 3 real
tritonservers with room for one model each, 6 models under Zipf popularity with a shift, under
placement by demand and under its LRU baseline (one run of each, shared by the tests). What the
benchmark prints as figures is checked here as outcomes: no request failed under demand placement,
no server held more than its capacity in any sample, models were loaded on demand, and the LRU
baseline's row is printed beside demand placement's with the figures of its own run."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "placement_bench.py"


class _Evictions(logging.Handler):
    """The controller's eviction lines (controller/reconcile.py logs each plan's evictions)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("placement_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both policies on the same small trace, as `make bench-placement` runs them."""
    bench = _bench()
    work = tmp_path_factory.mktemp("placement_bench")
    args = argparse.Namespace(
        models=6,
        room=1,
        duration=16,
        warmup=0,
        users=3,
        rate=1.0,
        zipf_s=1.1,
        target_rps=1.5,
        guard_s=1.0,
        policies="demand,lru",
        out=work / "placement.png",
    )
    evictions: dict[str, list[str]] = {}
    results = {}
    reconcile = logging.getLogger("controller.reconcile")
    level = reconcile.level
    reconcile.setLevel(logging.INFO)
    try:
        for policy in ("demand", "lru"):
            handler = _Evictions()
            reconcile.addHandler(handler)
            try:
                results[policy] = bench.run_policy(policy, args, work)
            finally:
                reconcile.removeHandler(handler)
            evictions[policy] = handler.lines
    finally:
        reconcile.setLevel(level)
    yield {"bench": bench, "results": results, "evictions": evictions, "work": work}


@pytest.mark.slow
def test_locust_trace_with_a_shift_fails_nothing_and_stays_within_capacity(bench_run: dict[str, Any]) -> None:
    result = bench_run["results"]["demand"]
    assert result.requests > 0 and result.failures == 0, result.failure_examples
    assert result.over_capacity == 0 and result.peak_fraction <= 1.0
    assert result.loads >= 3  # every server loaded what it was asked for, on demand


@pytest.mark.slow
def test_the_lru_baseline_is_printed_beside_demand_placement_from_its_own_run(
    bench_run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    bench, results, work = bench_run["bench"], bench_run["results"], bench_run["work"]
    demand, lru = results["demand"], results["lru"]
    # LRU placement placed the models of this run: its evictions, and only its own, are LRU's
    assert any("(least recently used, room for" in line for line in bench_run["evictions"]["lru"])
    assert not any("least recently used" in line for line in bench_run["evictions"]["demand"])
    # its figures are its own run's: the requests locust made and failed, loads its servers logged
    # (those that ended after the trace, while the stack stopped, are outside the measured run)
    with (work / "lru" / "locust_stats.csv").open() as f:
        total = next(row for row in csv.DictReader(f) if row["Name"] == "Aggregated")
    assert (lru.requests, lru.failures) == (int(total["Request Count"]), int(total["Failure Count"]))
    assert lru.requests > 0
    logs = "".join(p.read_text(errors="replace") for p in (work / "lru" / "logs").rglob("*.log"))
    assert 3 <= lru.loads <= logs.count("successfully loaded")
    assert lru.loads_timeline and lru.loads_timeline[-1][1] <= lru.loads
    assert lru.over_capacity == 0 and 0 < lru.peak_fraction <= 1.0

    bench.print_table([demand, lru])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "policy", "requests", "failed",
        "hot", "p50/p99", "ms", "warm", "p50/p99", "ms", "cold", "p50/p99", "ms",
        "loads", "loads/h", "peak", "mem",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[1:3]}
    for r in (demand, lru):
        row = rows[r.policy]
        assert row[1:3] == [str(r.requests), str(r.failures)]
        assert row[-3:] == [str(r.loads), f"{r.loads_per_hour:.0f}", f"{r.peak_fraction:.0%}"]
        for group in bench.GROUPS:  # p50/p99 of each group that had requests, as locust measured
            if group in r.latency_ms:
                p50, p99 = r.latency_ms[group]
                assert f"{p50:.0f}/{p99:.0f}" in row, (group, row)
    assert f"loads: demand / LRU = {demand.loads / lru.loads:.2f}" in lines
