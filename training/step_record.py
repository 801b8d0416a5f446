"""One training step's timings on one rank: what the skew monitor aggregates and the exporter publishes.

A leaf module, so the monitor and the metrics exporter both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepRecord:
    rank: int
    epoch: int
    step: int
    samples: int
    compute_s: float
    data_wait_s: float
    allreduce_wait_s: float
    step_s: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.compute_s if self.compute_s > 0 else 0.0
