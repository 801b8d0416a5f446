"""`make demo`'s job (`skewserve demo`) end to end, in its own folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "skewserve",
            "demo",
            "--out",
            str(tmp_path / "demo"),
            "--repo",
            str(tmp_path / "repo"),
            "--load-seconds",
            "5",
            "--epochs",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for step in (
        "step 1/9",
        "step 5/9: roll out the new versions",
        "step 9/9",
        "predictions through the gateway",
        "per-class recall",
        "demo finished",
    ):
        assert step in res.stdout
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    # The hit rate grows with how many requests fit in --load-seconds (Zipf keys repeat more often in
    # a longer run): a figure the demo prints, not a threshold to test. What must hold: no failures,
    # and the hot model's cache served hits.
    assert summary["failures"] == 0 and summary["requests"] > 0
    assert 0 < summary["cache_hit_rate"] <= 1
    assert (tmp_path / "repo" / "longtail" / "1" / "model.onnx").is_file()
    assert (tmp_path / "demo" / "loadtest" / "latency.png").is_file()
