"""Rank-speed balancing: split each global batch across ranks so their compute finishes together.

Ranks of unequal speed otherwise wait for the slowest at every gradient all-reduce. Every rank
reports its busy (compute) time and sample count for the step; each rank's share is then scaled by
(mean busy / its busy)^gain and smoothed. This feeds back on the objective itself (equal busy time)
rather than on samples/s, which per-step fixed costs distort: with cost a + b*n, samples/s falls as
a rank's share shrinks, and a throughput-proportional split spirals the slow rank's share down.

The update still equals the mean over the global batch: each rank's loss is
sum(per-sample loss) * world_size / global_batch, and DDP's all-reduce averages over world_size,
leaving sum over the global batch / global_batch whatever the split.
"""

from __future__ import annotations

import numpy as np

from training.sampler import largest_remainder


class RankSpeedBalancer:
    def __init__(
        self,
        world_size: int,
        enabled: bool = True,
        gain: float = 0.5,
        smoothing: float = 0.5,
        min_share: float = 0.02,
    ) -> None:
        if not 0 < gain <= 1 or not 0 < smoothing <= 1:
            raise ValueError(f"gain and smoothing must be within (0, 1], got {gain}, {smoothing}")
        self.world_size = world_size
        self.enabled = enabled
        self.gain = gain
        self.smoothing = smoothing
        self.min_share = min_share
        self._shares = np.full(world_size, 1.0 / world_size)

    def shares(self) -> np.ndarray:
        if not self.enabled:
            return np.full(self.world_size, 1.0 / self.world_size)
        return self._shares.copy()

    def split(self, global_batch: int) -> list[int]:
        """Per-rank sample counts for a global batch; each rank gets at least one sample."""
        if global_batch < self.world_size:
            raise ValueError(f"global batch {global_batch} is smaller than the world size {self.world_size}")
        counts = largest_remainder(self.shares(), global_batch - self.world_size) + 1
        return [int(c) for c in counts]

    def observe(self, busy_s: np.ndarray) -> None:
        """Fold one step's per-rank busy times (all ranks' values, already gathered) into the shares."""
        busy = np.asarray(busy_s, dtype=np.float64)
        if not np.all(np.isfinite(busy)) or np.any(busy <= 0):
            return
        target = self._shares * np.power(busy.mean() / busy, self.gain)
        target = np.maximum(target / target.sum(), self.min_share)
        target /= target.sum()
        self._shares = self.smoothing * target + (1 - self.smoothing) * self._shares
        self._shares /= self._shares.sum()

    def state_dict(self) -> dict[str, object]:
        return {"shares": self._shares.tolist()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._shares = np.asarray(state["shares"], dtype=np.float64)


def slice_for_rank(batch: np.ndarray, counts: list[int], rank: int) -> np.ndarray:
    start = int(sum(counts[:rank]))
    return batch[start : start + counts[rank]]
