"""The placement benchmark's trace, small: locust through the real gateway onto 3 real
tritonservers with room for one model each, 6 models under Zipf popularity with a shift, placement
by demand. What the benchmark prints as figures is checked here as outcomes: no request failed, no
server held more than its capacity in any sample, and models were loaded on demand."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "placement_bench.py"


@pytest.mark.slow
def test_locust_trace_with_a_shift_fails_nothing_and_stays_within_capacity(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("placement_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
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
        policies="demand",
        out=tmp_path / "placement.png",
    )
    result = bench.run_policy("demand", args, tmp_path)
    assert result.requests > 0 and result.failures == 0, result.failure_examples
    assert result.over_capacity == 0 and result.peak_fraction <= 1.0
    assert result.loads >= 3  # every server loaded what it was asked for, on demand
