"""Uneven, throughput-weighted shards give the same update as one process on the global batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from training.losses import SkewLoss
from training.model import MLPClassifier, ModelSpec
from training.speed_balance import RankSpeedBalancer, slice_for_rank


@pytest.mark.parametrize("loss_name", ["ce", "weighted_ce", "logit_adjusted", "focal"])
def test_weighted_uneven_shards_match_single_process_gradient(loss_name: str) -> None:
    torch.manual_seed(0)
    model = MLPClassifier(ModelSpec(n_features=6, n_classes=4, width=16, depth=2, dropout=0.0))
    loss_fn = SkewLoss(loss_name, np.array([100, 30, 8, 2]))
    x, y = torch.randn(50, 6), torch.randint(0, 4, (50,))

    ref = copy.deepcopy(model)
    loss_fn(ref(x), y).mean().backward()
    want = [p.grad.clone() for p in ref.parameters()]

    world = 3
    balancer = RankSpeedBalancer(world)
    for _ in range(10):
        balancer.observe(
            np.array([1.0, 3.0, 6.0]) * balancer.shares()
        )  # rank 0 three times as fast as rank 1
    counts = balancer.split(len(y))
    assert len(set(counts)) > 1 and sum(counts) == 50
    order = np.arange(50)
    summed = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(world):
        shard = copy.deepcopy(model)
        idx = torch.from_numpy(slice_for_rank(order, counts, rank))
        (loss_fn(shard(x[idx]), y[idx]).sum() * world / len(y)).backward()
        for acc, p in zip(summed, shard.parameters(), strict=True):
            acc += p.grad
    for got, exp in zip(summed, want, strict=True):
        torch.testing.assert_close(got / world, exp, rtol=1e-5, atol=1e-6)  # DDP's all-reduce mean


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
