"""Load and validate tabular classification data (CSV or Parquet) into arrays."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from training.errors import DataError

if TYPE_CHECKING:
    from training.datasets import LabelledData


@dataclass(frozen=True)
class Split:
    """One split as arrays: float32 features, int64 label indices into `classes`."""

    features: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def items(self, index: np.ndarray) -> tuple[np.ndarray, ...]:
        """A whole batch at once (tables live in memory; one gather beats per-row reads)."""
        return (self.features[index],)

    def item(self, index: int) -> tuple[np.ndarray, ...]:
        return (self.features[index],)


@dataclass(frozen=True)
class TabularDataset:
    train: Split
    val: Split
    test: Split | None
    feature_names: list[str]
    classes: list[str]
    data_hash: str

    @property
    def class_counts(self) -> np.ndarray:
        return np.bincount(self.train.labels, minlength=len(self.classes))


def read_table(path: Path) -> pd.DataFrame:
    """Read a CSV or Parquet file, refusing other formats by name."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.suffix in {".parquet", ".pq"}:
        return pd.read_parquet(path)
    if path.suffix in {".csv", ".txt"}:
        return pd.read_csv(path)
    raise DataError(f"unsupported data file {path.name}: use .csv or .parquet")


def _validate_frame(df: pd.DataFrame, label: str, split: str, feature_names: list[str] | None) -> list[str]:
    if label not in df.columns:
        raise DataError(f"{split} split has no label column {label!r}; columns are {list(df.columns)[:20]}")
    features = feature_names or [c for c in df.columns if c != label]
    missing = [c for c in features if c not in df.columns]
    if missing:
        raise DataError(f"{split} split lacks feature columns {missing}")
    if not features:
        raise DataError(f"{split} split has no feature columns besides the label {label!r}")
    problems = []
    for col in features:
        if not pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col]):
            problems.append(
                f"feature column {col!r} in the {split} split is not numeric (dtype {df[col].dtype}); "
                "encode it as numbers or drop it"
            )
            continue
        values = df[col].to_numpy(dtype=np.float64)
        bad = ~np.isfinite(values)
        if bad.any():
            n_nan = int(np.isnan(values).sum())
            problems.append(
                f"feature column {col!r} in the {split} split has {int(bad.sum())} non-finite values "
                f"({n_nan} NaN, {int(bad.sum()) - n_nan} inf); impute or drop those rows"
            )
    # Every column's problem at once: fixing one and rerunning to meet the next costs a user an hour.
    if problems:
        raise DataError("; ".join(problems))
    if df[label].isna().any():
        raise DataError(
            f"label column {label!r} in the {split} split has {int(df[label].isna().sum())} missing values"
        )
    return features


def _hash_frames(frames: list[pd.DataFrame]) -> str:
    h = hashlib.sha256()
    for df in frames:
        h.update(pd.util.hash_pandas_object(df, index=False).to_numpy().tobytes())
    return h.hexdigest()


def split_off_validation(
    df: pd.DataFrame, label: str, fraction: float, seed: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A stratified split: `fraction` of each class (at least one row of a class with two or more)
    goes to validation, the rest stays for training; the same seed gives the same split."""
    if not 0 < fraction < 1:
        raise DataError(f"--val-fraction must be within (0, 1), got {fraction}")
    if label not in df.columns:
        raise DataError(f"train split has no label column {label!r}; columns are {list(df.columns)[:20]}")
    rng = np.random.default_rng(seed)
    val_rows: list[int] = []
    for _, rows in df.groupby(df[label].astype(str), sort=True).indices.items():
        rows = rng.permutation(rows)
        n = int(round(len(rows) * fraction))
        val_rows += list(rows[: max(n, 1) if len(rows) >= 2 else 0])
    mask = np.zeros(len(df), dtype=bool)
    mask[val_rows] = True
    return df[~mask].reset_index(drop=True), df[mask].reset_index(drop=True)


def load_dataset(
    train_path: Path,
    val_path: Path | None,
    label: str = "label",
    test_path: Path | None = None,
    val_fraction: float | None = None,
    seed: int = 0,
) -> TabularDataset:
    """Load train/val(/test) files; every problem is refused with the column, class or count at fault.

    Without a validation file, `val_fraction` of each training class is split off as validation."""
    train_df = read_table(train_path)
    if val_path is None:
        assert val_fraction is not None
        train_df, val_df = split_off_validation(train_df, label, val_fraction, seed)
    else:
        val_df = read_table(val_path)
    features = _validate_frame(train_df, label, "train", None)
    _validate_frame(val_df, label, "val", features)
    test_df = read_table(test_path) if test_path else None
    if test_df is not None:
        _validate_frame(test_df, label, "test", features)

    classes = sorted({str(v) for v in train_df[label].unique()})
    if len(classes) < 2:
        raise DataError(
            f"training split has {len(classes)} class ({classes}); classification needs at least two"
        )
    index = {c: i for i, c in enumerate(classes)}

    def encode(df: pd.DataFrame, split: str) -> Split:
        names = df[label].astype(str)
        unknown = sorted(set(names) - set(index))
        if unknown:
            raise DataError(
                f"classes {unknown} appear in the {split} split but not in training; the model cannot "
                "predict them: add training rows for them or drop them from the split"
            )
        return Split(
            # Copies: pandas' copy-on-write hands out read-only views that torch refuses to wrap.
            features=np.array(df[features].to_numpy(dtype=np.float32), copy=True),
            labels=np.array(names.map(index).to_numpy(dtype=np.int64), copy=True),
        )

    frames = [train_df, val_df] + ([test_df] if test_df is not None else [])
    return TabularDataset(
        train=encode(train_df, "train"),
        val=encode(val_df, "val"),
        test=encode(test_df, "test") if test_df is not None else None,
        feature_names=list(features),
        classes=classes,
        data_hash=_hash_frames(frames),
    )


def load_data_dir(
    data_dir: Path, label: str = "label", val_fraction: float | None = None, seed: int = 0
) -> TabularDataset:
    """Load `train`, `val` and optional `test` files (.parquet or .csv) from a directory; with
    `val_fraction` and no `val` file, validation is split off the training file (stratified)."""
    data_dir = Path(data_dir)

    def find(name: str, required: bool) -> Path | None:
        for ext in (".parquet", ".csv"):
            if (data_dir / f"{name}{ext}").is_file():
                return data_dir / f"{name}{ext}"
        if required:
            hint = " (or pass --val-fraction to split it off train)" if name == "val" else ""
            raise DataError(f"{data_dir} has no {name}.parquet or {name}.csv{hint}")
        return None

    train, val = find("train", True), find("val", val_fraction is None)
    assert train is not None
    if val is not None and val_fraction is not None:
        raise DataError(f"{data_dir} has {val.name}: drop --val-fraction, or remove the file to split train")
    return load_dataset(train, val, label, find("test", False), val_fraction, seed)


def open_table(
    data_dir: Path, label: str = "label", val_fraction: float | None = None, seed: int = 0
) -> LabelledData:
    """A table data set as LabelledData: one float32 input `features`, standardisation stats."""
    from training.data_spec import DataSpec, InputSpec
    from training.datasets import LabelledData, class_warnings

    ds = load_data_dir(data_dir, label, val_fraction, seed)
    from training.model import standardisation

    mean, std = standardisation(ds.train.features)
    spec = DataSpec(
        kind="table",
        inputs=(InputSpec("features", "float32", (len(ds.feature_names),)),),
        classes=tuple(ds.classes),
        class_counts=tuple(int(c) for c in ds.class_counts),
        preprocessing={"feature_names": ds.feature_names, "mean": mean.tolist(), "std": std.tolist()},
    )
    labels = {"train": ds.train.labels, "val": ds.val.labels} | (
        {"test": ds.test.labels} if ds.test is not None else {}
    )
    return LabelledData(
        spec, ds.train, ds.val, ds.test, ds.data_hash, tuple(class_warnings(labels, ds.classes))
    )
