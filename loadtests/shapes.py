"""Load shapes (locust `LoadTestShape`) built from parameters: steady, ramp, spike, soak."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShapeParams:
    users: int
    spawn_rate: float
    duration_s: float


def shape_tick(kind: str, p: ShapeParams, t: float) -> tuple[int, float] | None:
    """(users, spawn rate) at run time t, or None when the run is over."""
    if t >= p.duration_s:
        return None
    if kind in ("steady", "soak"):
        # soak: the same plateau, meant for long durations (leaks, slow drift)
        return p.users, p.spawn_rate
    if kind == "ramp":
        # linear ramp to the peak over the first 80%, then hold
        frac = min(1.0, t / (0.8 * p.duration_s))
        return max(1, round(p.users * frac)), p.spawn_rate
    if kind == "spike":
        # a quarter of the users, a burst to all of them in the middle fifth, then back
        base = max(1, p.users // 4)
        in_spike = 0.4 * p.duration_s <= t < 0.6 * p.duration_s
        return (p.users if in_spike else base), max(p.spawn_rate, float(p.users))
    raise ValueError(f"unknown shape {kind!r}: use steady, ramp, spike or soak")


SHAPES = ("steady", "ramp", "spike", "soak")
