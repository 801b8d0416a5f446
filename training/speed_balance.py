"""Rank-speed balancing: split each global batch across ranks by measured throughput.

Ranks of unequal speed otherwise wait for the slowest at every gradient all-reduce. Each rank
reports samples per second of busy (compute) time; an EMA of these sets next step's shares, so all
ranks finish their compute together. The update still equals the mean over the global batch: each
rank's loss is sum(per-sample loss) * world_size / global_batch, and DDP's all-reduce averages over
world_size, leaving sum over the global batch / global_batch whatever the split.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from training.sampler import largest_remainder


class RankSpeedBalancer:
    def __init__(self, world_size: int, enabled: bool = True, ema: float = 0.5, min_share: float = 0.05) -> None:
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be within (0, 1], got {ema}")
        self.world_size = world_size
        self.enabled = enabled
        self.ema = ema
        self.min_share = min_share
        self.throughput = np.ones(world_size, dtype=np.float64)
        self._measured = False

    def shares(self) -> np.ndarray:
        if not self.enabled:
            return np.full(self.world_size, 1.0 / self.world_size)
        s = self.throughput / self.throughput.sum()
        s = np.maximum(s, self.min_share)
        return s / s.sum()

    def split(self, global_batch: int) -> list[int]:
        """Per-rank sample counts for a global batch; each rank gets at least one sample."""
        if global_batch < self.world_size:
            raise ValueError(f"global batch {global_batch} is smaller than the world size {self.world_size}")
        counts = largest_remainder(self.shares(), global_batch - self.world_size) + 1
        return [int(c) for c in counts]

    def observe(self, samples_per_second: np.ndarray) -> None:
        """Fold one step's per-rank throughput (all ranks' values, already gathered) into the EMA."""
        sps = np.asarray(samples_per_second, dtype=np.float64)
        if not np.all(np.isfinite(sps)) or np.any(sps <= 0):
            return
        if not self._measured:
            self.throughput = sps
            self._measured = True
        else:
            self.throughput = self.ema * sps + (1 - self.ema) * self.throughput

    def gather_and_observe(self, local_samples_per_second: float) -> np.ndarray:
        """All-gather every rank's throughput (one tiny collective) and update the EMA."""
        local = torch.tensor([local_samples_per_second], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
            dist.all_gather(out, local)
            values = torch.cat(out).numpy()
        else:
            values = local.numpy()
        self.observe(values)
        return values

    def state_dict(self) -> dict[str, object]:
        return {"throughput": self.throughput.tolist(), "measured": self._measured}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.throughput = np.asarray(state["throughput"], dtype=np.float64)
        self._measured = bool(state["measured"])


def slice_for_rank(batch: np.ndarray, counts: list[int], rank: int) -> np.ndarray:
    start = int(sum(counts[:rank]))
    return batch[start : start + counts[rank]]
