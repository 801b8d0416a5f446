"""What placement measures: each model's request rate per region, idle time per server, and its
footprint in bytes, from Triton's statistics API (the same call that says what is loaded).

The rate is the change of `inference_count` between passes, summed over a region's servers and
smoothed (EWMA); idle time comes from `last_inference`. The footprint is Triton's `memory_usage`
where the backend fills it, else the served version's files times `footprint_overhead`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SMOOTHING = 0.5  # weight of the newest pass in the rate


class DemandTracker:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: dict[tuple[str, str], tuple[int, float]] = {}  # (server, model) -> (count, when)
        self.rates: dict[tuple[str, str], float] = {}  # (region, model) -> requests per second
        self.reported_bytes: dict[str, int] = {}  # model -> bytes Triton reports for one copy

    def observe(self, region: dict[str, str], stats: dict[str, list[dict[str, Any]]]) -> None:
        now = self.clock()
        fresh: dict[tuple[str, str], float] = {}
        for server, entries in stats.items():
            counts: dict[str, int] = {}
            for e in entries:
                counts[e["name"]] = counts.get(e["name"], 0) + int(e.get("inference_count", 0))
                used = sum(int(u.get("byte_size", 0)) for u in e.get("memory_usage", []) or [])
                if used > 0:
                    self.reported_bytes[e["name"]] = max(used, self.reported_bytes.get(e["name"], 0))
            for model, count in counts.items():
                before = self._last.get((server, model))
                self._last[(server, model)] = (count, now)
                if before is None or count < before[0] or now <= before[1]:
                    continue  # first sight, or the server restarted: no rate from this pair
                key = (region[server], model)
                fresh[key] = fresh.get(key, 0.0) + (count - before[0]) / (now - before[1])
        for key in set(self.rates) | set(fresh):
            self.rates[key] = SMOOTHING * fresh.get(key, 0.0) + (1 - SMOOTHING) * self.rates.get(key, 0.0)

    def rate(self, region: str, model: str) -> float:
        return self.rates.get((region, model), 0.0)


def idle_seconds(entries: list[dict[str, Any]], model: str, now_epoch_s: float) -> float:
    """Seconds since the server last ran `model` (infinite if it never did since loading it)."""
    last = max((int(e.get("last_inference", 0)) for e in entries if e["name"] == model), default=0)
    return max(0.0, now_epoch_s - last / 1000) if last else float("inf")
