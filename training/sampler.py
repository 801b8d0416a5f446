"""Class-balanced distributed sampling.

Classes are drawn with probability proportional to n_c^q (q = 1: natural frequencies, q = 0:
class-uniform; Kang et al., ICLR 2020, "Decoupling Representation and Classifier"). Each epoch's
draw is a pure function of (seed, epoch): every rank computes the same global draw and keeps its
own share, so ranks need no communication, get exactly the same number of samples (the total is a
multiple of the world size: no padding duplicates as torch's DistributedSampler adds), and take
disjoint positions of the draw. Shares are dealt from the class-sorted draw, so each rank's class
counts differ from any other rank's by at most one per class.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler


def largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to `total`, proportional to `weights` (Hamilton's method)."""
    weights = np.asarray(weights, dtype=np.float64)
    if total < 0 or weights.sum() <= 0:
        raise ValueError(f"cannot apportion {total} over weights {weights}")
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


class ClassBalancedSampler(Sampler[int]):
    """Draws n_c^q-weighted class samples; `rank_indices` for a rank, `global_indices` for all ranks."""

    def __init__(
        self,
        labels: np.ndarray,
        num_replicas: int = 1,
        rank: int = 0,
        q: float = 1.0,
        seed: int = 0,
        samples_per_epoch: int | None = None,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is out of range for num_replicas={num_replicas}")
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be within [0, 1] (1 natural, 0 class-uniform), got {q}")
        self.labels = np.asarray(labels, dtype=np.int64)
        if self.labels.size == 0:
            raise ValueError("cannot sample from an empty label array")
        self.num_replicas = num_replicas
        self.rank = rank
        self.q = q
        self.seed = seed
        total = samples_per_epoch if samples_per_epoch is not None else len(self.labels)
        self.per_rank = total // num_replicas
        if self.per_rank < 1:
            raise ValueError(f"{total} samples per epoch cannot give each of {num_replicas} ranks one sample")
        self.total = self.per_rank * num_replicas
        self.epoch = 0
        self.class_members = [np.flatnonzero(self.labels == c) for c in range(int(self.labels.max()) + 1)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def class_probabilities(self) -> np.ndarray:
        counts = np.array([len(m) for m in self.class_members], dtype=np.float64)
        weights = np.where(counts > 0, np.power(np.maximum(counts, 1.0), self.q), 0.0)
        return weights / weights.sum()

    def _class_sorted_draw(self, rng: np.random.Generator) -> np.ndarray:
        draws = largest_remainder(self.class_probabilities(), self.total)
        parts = []
        for members, k in zip(self.class_members, draws, strict=True):
            if k == 0:
                continue
            # Whole permutations before any repeat: an oversampled class repeats each member as
            # evenly as possible rather than at random.
            reps = -(-int(k) // len(members))
            cycle = np.concatenate([rng.permutation(members) for _ in range(reps)])
            parts.append(cycle[:k])
        return np.concatenate(parts)

    def global_indices(self, epoch: int | None = None) -> np.ndarray:
        """The whole epoch's draw, shuffled: what rank-speed balancing splits batch by batch."""
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        return rng.permutation(self._class_sorted_draw(rng))

    def rank_indices(self, rank: int | None = None, epoch: int | None = None) -> np.ndarray:
        rank = self.rank if rank is None else rank
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        sorted_draw = self._class_sorted_draw(rng)
        shares = [sorted_draw[r :: self.num_replicas][: self.per_rank] for r in range(self.num_replicas)]
        order_rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch, 1 + rank])
        return order_rng.permutation(shares[rank])

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_indices().tolist())

    def __len__(self) -> int:
        return self.per_rank
