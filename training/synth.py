"""A reproducible long-tailed classification data set (the standard long-tail protocol).

Training class sizes decay exponentially from n_max to n_max / imbalance_ratio (Cui et al. 2019,
"Class-Balanced Loss Based on Effective Number of Samples", CIFAR-LT construction); validation and
test splits are class-balanced so balanced accuracy measures every class equally. Each class is a
mixture of Gaussian clusters in the informative subspace, so the boundary is not linear.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field, model_validator


class SynthSpec(BaseModel):
    n_classes: int = Field(default=10, ge=2)
    imbalance_ratio: float = Field(default=100.0, ge=1.0)
    n_max: int = Field(default=2000, ge=2)
    n_features: int = Field(default=16, ge=1)
    n_informative: int = Field(default=8, ge=1)
    clusters_per_class: int = Field(default=2, ge=1)
    cluster_spread: float = Field(default=1.0, gt=0)
    class_separation: float = Field(default=1.4, gt=0)
    label_noise: float = Field(default=0.0, ge=0, lt=1)
    covariate_shift: float = Field(default=0.0, ge=0, description="mean shift of test features, in std units")
    n_val_per_class: int = Field(default=100, ge=1)
    n_test_per_class: int = Field(default=200, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SynthSpec:
        if self.n_informative > self.n_features:
            raise ValueError(
                f"n_informative ({self.n_informative}) cannot exceed n_features ({self.n_features})"
            )
        if self.n_max / self.imbalance_ratio < 1:
            raise ValueError(
                f"n_max / imbalance_ratio = {self.n_max / self.imbalance_ratio:.2f} leaves the rarest class empty; "
                "raise n_max or lower imbalance_ratio"
            )
        return self

    def class_sizes(self) -> list[int]:
        c = self.n_classes
        return [max(1, int(round(self.n_max * self.imbalance_ratio ** (-i / (c - 1))))) for i in range(c)]


def _draw(
    spec: SynthSpec, rng: np.random.Generator, centers: np.ndarray, sizes: list[int], shift: float
) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for cls, n in enumerate(sizes):
        which = rng.integers(0, spec.clusters_per_class, size=n)
        informative = centers[cls, which] + rng.normal(0, spec.cluster_spread, size=(n, spec.n_informative))
        noise = rng.normal(0, 1.0, size=(n, spec.n_features - spec.n_informative))
        x = np.concatenate([informative, noise], axis=1)
        xs.append(x)
        ys.append(np.full(n, cls))
    x = np.concatenate(xs).astype(np.float32)
    y = np.concatenate(ys)
    if shift:
        x[:, : spec.n_informative] += shift * spec.cluster_spread
    # Raw features on varied scales and offsets, as real tables have: standardisation must matter.
    scales = np.linspace(0.5, 50.0, spec.n_features).astype(np.float32)
    offsets = np.linspace(-10, 100, spec.n_features).astype(np.float32)
    return x * scales + offsets, y


def generate(spec: SynthSpec) -> dict[str, pd.DataFrame]:
    """Return train / val / test frames with columns f00.. and `label` (class names `class_00`..)."""
    rng = np.random.default_rng(spec.seed)
    centers = rng.normal(
        0, spec.class_separation, size=(spec.n_classes, spec.clusters_per_class, spec.n_informative)
    )
    frames: dict[str, pd.DataFrame] = {}
    plan = {
        "train": (spec.class_sizes(), 0.0),
        "val": ([spec.n_val_per_class] * spec.n_classes, 0.0),
        "test": ([spec.n_test_per_class] * spec.n_classes, spec.covariate_shift),
    }
    names = [f"f{i:02d}" for i in range(spec.n_features)]
    for split, (sizes, shift) in plan.items():
        x, y = _draw(spec, rng, centers, sizes, shift)
        if split == "train" and spec.label_noise > 0:
            flip = rng.random(len(y)) < spec.label_noise
            y = y.copy()
            y[flip] = rng.integers(0, spec.n_classes, size=int(flip.sum()))
        order = rng.permutation(len(y))
        df = pd.DataFrame(x[order], columns=names)
        df["label"] = [f"class_{c:02d}" for c in y[order]]
        frames[split] = df
    return frames


def write(spec: SynthSpec, out_dir: Path) -> dict[str, Path]:
    """Write the splits as Parquet plus `dataset.json` describing how they were made."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, df in generate(spec).items():
        path = out_dir / f"{split}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        df.to_parquet(tmp, index=False)
        tmp.replace(path)
        paths[split] = path
    (out_dir / "dataset.json").write_text(
        json.dumps({"spec": spec.model_dump(), "train_class_sizes": spec.class_sizes()}, indent=2)
    )
    return paths
