"""Per-rank skew monitor: step timings as JSON lines beside the checkpoints, and epoch summaries.

Per step and rank: busy (compute) time, data-wait time, time waiting in the gradient all-reduce and
samples/s. The step durations come from a `training.device.StepClock`, CUDA events on a GPU, so
they are device compute time rather than kernel-launch time. Per epoch: the imbalance ratio max/mean of per-rank mean busy time (1.0 means no rank
waits for another) and the per-class sample counts actually seen, summed over ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from training.metrics_export import rank_exporter
from training.step_record import StepRecord


@dataclass
class EpochAccumulator:
    n_classes: int
    steps: int = 0
    busy_s: float = 0.0
    data_wait_s: float = 0.0
    allreduce_wait_s: float = 0.0
    samples: int = 0
    class_counts: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        self.class_counts = np.zeros(self.n_classes, dtype=np.int64)


class SkewMonitor:
    def __init__(
        self,
        directory: Path,
        rank: int,
        world_size: int,
        n_classes: int,
        device: torch.device | None = None,
    ) -> None:
        self.rank = rank
        # Collective tensors must live where the backend works: NCCL only moves CUDA tensors.
        self.device = device or torch.device("cpu")
        self.world_size = world_size
        self.n_classes = n_classes
        directory.mkdir(parents=True, exist_ok=True)
        self.step_path = directory / f"monitor-rank{rank}.jsonl"
        self.epoch_path = directory / "monitor-epochs.jsonl"
        self._file = open(self.step_path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.epoch = EpochAccumulator(n_classes)
        self.exporter = rank_exporter(rank)  # live Prometheus metrics, when switched on (metrics_export)

    def start_epoch(self) -> None:
        self.epoch = EpochAccumulator(self.n_classes)

    def record(self, rec: StepRecord, labels: np.ndarray) -> None:
        self.epoch.steps += 1
        self.epoch.busy_s += rec.compute_s + rec.data_wait_s
        self.epoch.data_wait_s += rec.data_wait_s
        self.epoch.allreduce_wait_s += rec.allreduce_wait_s
        self.epoch.samples += rec.samples
        self.epoch.class_counts += np.bincount(labels, minlength=self.n_classes)
        row = asdict(rec) | {"samples_per_s": round(rec.samples_per_s, 1)}
        self._file.write(json.dumps(row) + "\n")
        if self.exporter is not None:
            self.exporter.step(rec)

    def finish_epoch(self, epoch: int, wall_s: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Combine every rank's epoch totals (collective: all ranks call it) and log the summary."""
        acc = self.epoch
        local = torch.tensor(
            [
                acc.busy_s / max(1, acc.steps),
                acc.allreduce_wait_s / max(1, acc.steps),
                acc.data_wait_s / max(1, acc.steps),
                float(acc.samples),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        counts = torch.tensor(acc.class_counts, dtype=torch.int64, device=self.device)
        if self.world_size > 1 and dist.is_initialized():
            gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local)
            dist.all_reduce(counts)
            per_rank = torch.stack(gathered).cpu().numpy()
        else:
            per_rank = local.cpu().numpy()[None, :]
        busy = per_rank[:, 0]
        summary: dict[str, Any] = {
            "epoch": epoch,
            "wall_s": round(wall_s, 4),
            "steps": acc.steps,
            "imbalance_ratio": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            "busy_s_per_step": [round(float(v), 6) for v in busy],
            "allreduce_wait_s_per_step": [round(float(v), 6) for v in per_rank[:, 1]],
            "data_wait_s_per_step": [round(float(v), 6) for v in per_rank[:, 2]],
            "samples_per_rank": [int(v) for v in per_rank[:, 3]],
            "class_counts_seen": counts.cpu().tolist(),
        } | (extra or {})
        if self.rank == 0:
            with open(self.epoch_path, "a") as f:
                f.write(json.dumps(summary) + "\n")
        if self.exporter is not None:
            self.exporter.finished_epoch(summary)
        return summary

    def close(self) -> None:
        """Close the step log and stop the live metrics listener; a second call does nothing."""
        self._file.close()
        exporter, self.exporter = self.exporter, None
        if exporter is not None:
            exporter.close()
