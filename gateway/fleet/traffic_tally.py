"""What a gateway worker saw of one model's canary: answers per role (stable, canary, shadow) with
errors and a latency histogram, and per class of the stable answer how often it was mirrored and
whether the shadow agreed. Cumulative per canary, so a report lost on the way changes nothing.

The same types are the body of the controller's traffic API (controller/traffic_gate.py sums them
over gateways and judges the canary's gate), so both sides count latency in the same buckets.
"""

from __future__ import annotations

import bisect
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["stable", "canary", "shadow"]
ROLES: tuple[Role, ...] = ("stable", "canary", "shadow")
# Log-spaced upper edges in seconds (about 12% apart): p99 is read as a bucket's upper edge.
LATENCY_EDGES: tuple[float, ...] = tuple(round(0.0001 * 1.12**i, 7) for i in range(100))
MAX_CLASSES = 1024  # per model: labels and report bodies stay bounded whatever a model answers


class RoleTally(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: int = Field(default=0, ge=0)
    errors: int = Field(default=0, ge=0)
    buckets: list[int] = Field(default_factory=lambda: [0] * (len(LATENCY_EDGES) + 1))

    def observe(self, seconds: float, ok: bool) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
        self.buckets[bisect.bisect_left(LATENCY_EDGES, seconds)] += 1

    def add(self, other: RoleTally) -> None:
        self.requests += other.requests
        self.errors += other.errors
        if len(other.buckets) == len(self.buckets):
            self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]

    def quantile(self, q: float) -> float | None:
        """The upper edge of the bucket holding the q-quantile; None without answers."""
        total = sum(self.buckets)
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for i, n in enumerate(self.buckets):
            seen += n
            if seen >= rank and n:
                return LATENCY_EDGES[i] if i < len(LATENCY_EDGES) else float("inf")
        return float("inf")

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class ClassTally(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seen: int = Field(default=0, ge=0, description="stable answers of this class")
    mirrored: int = Field(default=0, ge=0)
    agree: int = Field(default=0, ge=0)
    disagree: int = Field(default=0, ge=0)
    error: int = Field(default=0, ge=0, description="mirrored requests the shadow failed")

    def add(self, other: ClassTally) -> None:
        self.seen += other.seen
        self.mirrored += other.mirrored
        self.agree += other.agree
        self.disagree += other.disagree
        self.error += other.error

    @property
    def agreement(self) -> float | None:
        judged = self.agree + self.disagree
        return self.agree / judged if judged else None


class ModelTally(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(description="the canary's version")
    started: float = Field(description="when the canary started: a restarted canary counts afresh")
    roles: dict[Role, RoleTally] = Field(default_factory=lambda: {r: RoleTally() for r in ROLES})
    classes: dict[str, ClassTally] = Field(default_factory=dict, max_length=MAX_CLASSES)
    skipped: int = Field(default=0, ge=0, description="requests left unmirrored: shadow busy or too large")

    def add(self, other: ModelTally) -> None:
        for role, tally in other.roles.items():
            self.roles.setdefault(role, RoleTally()).add(tally)
        for name, c in other.classes.items():
            self.classes.setdefault(name, ClassTally()).add(c)
        self.skipped += other.skipped


class TrafficReport(BaseModel):
    """One gateway worker's cumulative tallies, keyed by model."""

    model_config = ConfigDict(extra="forbid")

    reporter: str = Field(min_length=1, max_length=200)
    region: str = Field(default="", max_length=200)
    models: dict[str, ModelTally] = Field(default_factory=dict, max_length=4096)
