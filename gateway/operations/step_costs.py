"""Where a request's time goes, step by step (`step_timing: true` in the gateway config).

Each step's wall time is added to its name; the upstream's own wait is counted apart (`upstream`),
so at concurrency 1, where nothing else runs between a step's awaits, a step's time is its CPU.
Off by default: the timers cost two clock reads per step.
"""

from __future__ import annotations

import time


class StepCosts:
    __slots__ = ("enabled", "seconds", "calls")

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def now(self) -> float:
        return time.perf_counter() if self.enabled else 0.0

    def lap(self, step: str, since: float) -> float:
        """Add the time since `since` to `step`; the time now, to pass to the next lap."""
        if not self.enabled:
            return 0.0
        now = time.perf_counter()
        self.add(step, now - since)
        return now

    def add(self, step: str, seconds: float) -> None:
        self.seconds[step] = self.seconds.get(step, 0.0) + seconds
        self.calls[step] = self.calls.get(step, 0) + 1
