"""A model in canary as the gateway serves it: its versions, shares and tally (`Plan`, kept by
gateway/fleet/traffic.py), and the class sampler its shadow traffic is drawn with
(gateway/fleet/shadow.py). A leaf, so that both modules name these types without naming each other.

Uniform sampling mirrors each class in proportion to its traffic; here the mirrored share is spread
as evenly over classes as the share allows (water-filling): with class frequencies f and share s,
class c is mirrored with probability min(1, λ/f_c), where λ makes the expected mirrored share equal s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.fleet.traffic_tally import ModelTally

RECOMPUTE_EVERY = 32  # observations between two water-fillings


def water_fill(freqs: dict[str, float], share: float) -> dict[str, float]:
    """Per class, the probability of mirroring it so that the mirrored share is `share` and spread
    as evenly over classes as it allows."""
    if share >= 1.0 or not freqs:
        return dict.fromkeys(freqs, 1.0)
    ordered = sorted(freqs.items(), key=lambda kv: kv[1])
    remaining, level = share, None
    for i, (_, f) in enumerate(ordered):
        left = len(ordered) - i
        if f * left >= remaining:
            level = remaining / left
            break
        remaining -= f
    if level is None:
        return dict.fromkeys(freqs, 1.0)
    return {c: min(1.0, level / f) if f > 0 else 1.0 for c, f in freqs.items()}


class ClassSampler:
    """Class frequencies of the stable answers, and the mirroring probability each gets."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.total = 0
        self._probs: dict[str, float] = {}
        self._share = -1.0
        self._since = 0

    def observe(self, classes: list[str]) -> None:
        for c in classes:
            self.seen[c] = self.seen.get(c, 0) + 1
        self.total += len(classes)
        self._since += len(classes)

    def probability(self, cls: str, share: float) -> float:
        if cls not in self._probs or share != self._share or self._since >= RECOMPUTE_EVERY:
            self._probs = water_fill({c: n / self.total for c, n in self.seen.items()}, share)
            self._share, self._since = share, 0
        return self._probs.get(cls, 1.0)


@dataclass
class Plan:
    model: str
    stable: str
    canary: str
    share: float
    shadow: float
    started: float
    tally: ModelTally
    sampler: ClassSampler = field(default_factory=ClassSampler)
