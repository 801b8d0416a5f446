"""Skewed request mixes: Zipf-distributed hot keys, a hot/cold model mix, pinned regions.

Everything here is a pure function of its settings and a random generator, so the mixes are
reproducible and testable without locust.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# One served input: name, Triton datatype, per-item shape (the batch axis excluded; -1 dynamic).
InputDesc = tuple[str, str, tuple[int, ...]]
TYPICAL_LENGTH = 16  # what a dynamic dimension takes in synthetic requests
NUMPY = {
    "FP32": np.float32, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32,
    "UINT8": np.uint8, "BOOL": np.bool_, "BYTES": np.object_,
}  # fmt: skip


@dataclass(frozen=True)
class MixSettings:
    model: str
    n_features: int = 0  # the table contract's width, when `inputs` is not given
    keys: int = 1000
    zipf_s: float = 1.1
    cold_model: str = ""
    cold_fraction: float = 0.0
    regions: tuple[str, ...] = ()
    seed: int = 0
    # The model's inputs as its metadata gives them; empty: one FP32 `features` of n_features.
    inputs: tuple[InputDesc, ...] = ()
    # A data directory (any layout `skewserve train` reads) to draw real samples from.
    samples: str = ""

    ENV = "SKEWSERVE_LT_"

    @property
    def tensors(self) -> tuple[InputDesc, ...]:
        return self.inputs or (("features", "FP32", (self.n_features,)),)

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
            f"{self.ENV}INPUTS": json.dumps([[n, d, list(shape)] for n, d, shape in self.inputs]),
            f"{self.ENV}SAMPLES": self.samples,
        }

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MixSettings:
        e = os.environ if env is None else env
        p = cls.ENV
        if f"{p}MODEL" not in e or f"{p}FEATURES" not in e:
            raise RuntimeError(
                f"{p}MODEL and {p}FEATURES must be set; run load tests through `skewserve loadtest`"
            )
        inputs = tuple((n, d, tuple(shape)) for n, d, shape in json.loads(e.get(f"{p}INPUTS", "[]")))
        return cls(
            model=e[f"{p}MODEL"],
            n_features=int(e[f"{p}FEATURES"]),
            keys=int(e.get(f"{p}KEYS", "1000")),
            zipf_s=float(e.get(f"{p}ZIPF_S", "1.1")),
            cold_model=e.get(f"{p}COLD_MODEL", ""),
            cold_fraction=float(e.get(f"{p}COLD_FRACTION", "0")),
            regions=tuple(r for r in e.get(f"{p}REGIONS", "").split(",") if r),
            seed=int(e.get(f"{p}SEED", "0")),
            inputs=inputs,
            samples=e.get(f"{p}SAMPLES", ""),
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
    rows: list[tuple[np.ndarray, ...]] = field(init=False)
    cdf: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        data_rng = np.random.default_rng(s.seed)  # same key space in every user and process
        if s.samples:
            self.rows = real_rows(Path(s.samples), s.tensors, s.keys)
        else:
            self.rows = [synthetic_row(s.tensors, data_rng) for _ in range(s.keys)]
        self.cdf = np.cumsum(zipf_probabilities(s.keys, s.zipf_s))
        self.rng = np.random.default_rng()

    def tensors(self, row: tuple[np.ndarray, ...]) -> tuple[tuple[str, str, np.ndarray], ...]:
        """A drawn row with each array's input name and datatype, as the wire encoders take it."""
        return tuple((n, d, x) for (n, d, _), x in zip(self.settings.tensors, row, strict=True))

    def key(self) -> int:
        return min(int(np.searchsorted(self.cdf, self.rng.random())), self.settings.keys - 1)

    def model(self) -> str:
        s = self.settings
        return s.cold_model if s.cold_model and self.rng.random() < s.cold_fraction else s.model

    def region(self) -> str | None:
        regions = self.settings.regions
        return regions[int(self.rng.integers(len(regions)))] if regions else None

    def draw(self) -> tuple[str, int, tuple[np.ndarray, ...], str | None]:
        k = self.key()
        return self.model(), k, self.rows[k % len(self.rows)], self.region()


def synthetic_row(tensors: tuple[InputDesc, ...], rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """One request's tensors (batch 1) drawn within each dtype's range; token-like ints in [1, 32)."""
    out = []
    for _, dtype, dims in tensors:
        shape = (1, *(TYPICAL_LENGTH if d == -1 else d for d in dims))
        if dtype in ("FP32", "FP16"):
            out.append((rng.standard_normal(shape) * 10).astype(NUMPY[dtype]))
        elif dtype == "UINT8":
            out.append(rng.integers(0, 256, shape, dtype=np.uint8))
        elif dtype == "BOOL":
            out.append(rng.random(shape) < 0.5)
        elif dtype == "BYTES":
            raise ValueError(
                "the model takes BYTES (raw images or text): pass --samples DATA_DIR so requests carry "
                "real encoded images or text"
            )
        else:
            out.append(rng.integers(1, 32, shape).astype(NUMPY[dtype]))
    return tuple(out)


def real_rows(data_dir: Path, tensors: tuple[InputDesc, ...], keys: int) -> list[tuple[np.ndarray, ...]]:
    """Up to `keys` requests of real samples: encoded image files or text for a BYTES input (the
    `<model>_raw` ensembles), else the validation items of the inputs the model names."""
    if len(tensors) == 1 and tensors[0][1] == "BYTES":
        return [(np.array([[item]], dtype=object),) for item in _raw_items(data_dir, keys)]
    from training.data_source import open_data
    from training.datasets import SplitDataset

    data = open_data(data_dir, augment=False)
    names = [s.name for s in data.spec.inputs]
    missing = [n for n, _, _ in tensors if n not in names]
    if missing:
        raise ValueError(
            f"--samples {data_dir} has inputs {names}; the model takes {[n for n, _, _ in tensors]}"
        )
    val = SplitDataset(data.val, data.spec)
    rows = []
    for i in range(min(keys, len(val))):
        inputs, _ = val.__getitems__([i])
        by_name = dict(zip(names, (t.numpy() for t in inputs), strict=True))
        rows.append(tuple(by_name[n].astype(NUMPY[d]) for n, d, _ in tensors))
    return rows


def _raw_items(data_dir: Path, keys: int) -> list[bytes]:
    """Encoded images of an image-folder set, or texts rebuilt from token shards and vocab.txt."""
    files = sorted(p for p in data_dir.glob("val/*/*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if files:
        return [p.read_bytes() for p in files[:keys]]
    vocab = data_dir / "vocab.txt"
    if vocab.is_file():
        words = vocab.read_text(encoding="utf-8").splitlines()
        tokens = np.load(data_dir / "val" / "tokens.npy", mmap_mode="r")
        return [" ".join(words[int(t) - 2] for t in row if t >= 2).encode() for row in tokens[:keys]]
    raise ValueError(f"--samples {data_dir} holds no val/<class>/ images and no vocab.txt for raw text")
