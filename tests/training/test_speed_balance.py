"""Uneven, throughput-weighted shards give the same gradient as one process on the global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training.grad_probe import LOSSES
from training.speed_balance import RankSpeedBalancer


def test_real_step_on_two_gloo_ranks_with_unequal_splits_equals_the_full_batch_gradient(
    small_data: Path, tmp_path: Path
) -> None:
    """`Trainer._step` on 2 torchrun/gloo ranks (a 48/16 split) vs one process on the whole batch.

    grad_probe.py ends with os._exit(0) once every result is saved and the process group destroyed:
    with three DDP reducers on gloo in one process, about one exit in ten aborts in a C++ destructor
    at interpreter teardown ("terminate called without an active exception"). That cannot hide a
    wrong answer: this test judges only the saved files, every one of them (both ranks and the single
    process, per loss), and a probe that fails before saving exits non-zero or leaves a file missing.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    probe = ["-m", "tests.training.grad_probe", "--data", str(small_data), "--out", str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    for cmd in ([*torchrun, *probe], [sys.executable, *probe]):
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for loss in LOSSES:
        ranks = [torch.load(tmp_path / loss / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
        single = torch.load(tmp_path / loss / "single.pt", weights_only=False)["grads"]
        assert ranks[0]["counts"] == [48, 16]  # the split the shares ask for: unequal
        assert [len(r["local"]) for r in ranks] == [48, 16]
        np.testing.assert_array_equal(np.concatenate([r["local"] for r in ranks]), ranks[0]["batch"])
        assert single.keys() == ranks[0]["grads"].keys()
        for name, want in single.items():
            # DDP leaves both ranks the same averaged gradient; it equals the full-batch gradient up to
            # float32 summation order (measured differences ~1e-8).
            torch.testing.assert_close(ranks[1]["grads"][name], ranks[0]["grads"][name], rtol=0, atol=0)
            torch.testing.assert_close(
                ranks[0]["grads"][name], want, rtol=1e-5, atol=1e-7, msg=f"{loss} {name}"
            )
        assert max(float(g.abs().max()) for g in single.values()) > 1e-3  # a gradient, not zeros


def test_shares_converge_to_equal_busy_time_despite_fixed_step_cost() -> None:
    b = RankSpeedBalancer(2)
    per_sample = np.array([1.0, 2.0])  # rank 1 is 2x slower
    fixed = 50.0  # per-step overhead, same on both ranks
    for _ in range(40):
        n = np.array(b.split(300), dtype=float)
        b.observe(fixed * (per_sample / per_sample.min()) + per_sample * n)
    n = np.array(b.split(300), dtype=float)
    busy = fixed * per_sample + per_sample * n
    assert busy.max() / busy.mean() < 1.02
    assert n[0] > n[1]


def test_extreme_imbalance_still_gives_everyone_a_sample() -> None:
    b = RankSpeedBalancer(2)
    for _ in range(50):
        b.observe(np.array([1.0, 1e6]))
    assert min(b.split(10)) >= 1


def test_disabled_balancer_splits_equally() -> None:
    b = RankSpeedBalancer(4, enabled=False)
    b.observe(np.array([9.0, 1.0, 1.0, 1.0]))
    assert b.split(64) == [16, 16, 16, 16]


def test_global_batch_smaller_than_world_is_refused() -> None:
    with pytest.raises(ValueError, match="global batch 1 is smaller than the world size 2"):
        RankSpeedBalancer(2).split(1)
