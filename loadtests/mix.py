"""Skewed request mixes: Zipf-distributed hot keys, a hot/cold model mix, pinned regions.

Everything here is a pure function of its settings and a random generator, so the mixes are
reproducible and testable without locust.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class MixSettings:
    model: str
    n_features: int
    keys: int = 1000
    zipf_s: float = 1.1
    cold_model: str = ""
    cold_fraction: float = 0.0
    regions: tuple[str, ...] = ()
    seed: int = 0

    ENV = "SKEWSERVE_LT_"

    def to_env(self) -> dict[str, str]:
        return {
            f"{self.ENV}MODEL": self.model,
            f"{self.ENV}FEATURES": str(self.n_features),
            f"{self.ENV}KEYS": str(self.keys),
            f"{self.ENV}ZIPF_S": str(self.zipf_s),
            f"{self.ENV}COLD_MODEL": self.cold_model,
            f"{self.ENV}COLD_FRACTION": str(self.cold_fraction),
            f"{self.ENV}REGIONS": ",".join(self.regions),
            f"{self.ENV}SEED": str(self.seed),
        }

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MixSettings:
        e = os.environ if env is None else env
        p = cls.ENV
        if f"{p}MODEL" not in e or f"{p}FEATURES" not in e:
            raise RuntimeError(
                f"{p}MODEL and {p}FEATURES must be set; run load tests through `skewserve loadtest`"
            )
        return cls(
            model=e[f"{p}MODEL"],
            n_features=int(e[f"{p}FEATURES"]),
            keys=int(e.get(f"{p}KEYS", "1000")),
            zipf_s=float(e.get(f"{p}ZIPF_S", "1.1")),
            cold_model=e.get(f"{p}COLD_MODEL", ""),
            cold_fraction=float(e.get(f"{p}COLD_FRACTION", "0")),
            regions=tuple(r for r in e.get(f"{p}REGIONS", "").split(",") if r),
            seed=int(e.get(f"{p}SEED", "0")),
        )


def zipf_probabilities(keys: int, s: float) -> np.ndarray:
    """P(rank k) ∝ 1 / k^s over k = 1..keys (a bounded Zipf; s = 0 is uniform)."""
    if keys < 1:
        raise ValueError(f"keys must be at least 1, got {keys}")
    weights = 1.0 / np.power(np.arange(1, keys + 1, dtype=np.float64), s)
    return weights / weights.sum()


@dataclass
class RequestMix:
    """Draws (model, input row, pinned region) triples following the settings."""

    settings: MixSettings
    rng: np.random.Generator = field(init=False)
    rows: np.ndarray = field(init=False)
    cdf: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        data_rng = np.random.default_rng(s.seed)  # same key space in every user and process
        self.rows = (data_rng.standard_normal((s.keys, s.n_features)) * 10).astype(np.float32)
        self.cdf = np.cumsum(zipf_probabilities(s.keys, s.zipf_s))
        self.rng = np.random.default_rng()

    def key(self) -> int:
        return min(int(np.searchsorted(self.cdf, self.rng.random())), self.settings.keys - 1)

    def model(self) -> str:
        s = self.settings
        return s.cold_model if s.cold_model and self.rng.random() < s.cold_fraction else s.model

    def region(self) -> str | None:
        regions = self.settings.regions
        return regions[int(self.rng.integers(len(regions)))] if regions else None

    def draw(self) -> tuple[str, int, np.ndarray, str | None]:
        k = self.key()
        return self.model(), k, self.rows[k : k + 1], self.region()
