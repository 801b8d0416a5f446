"""Every bad-input case is refused with a message naming the problem."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from training.data import load_data_dir
from training.errors import DataError
from training.synth import SynthSpec, generate


def _write(tmp: Path, train: pd.DataFrame, val: pd.DataFrame) -> Path:
    train.to_csv(tmp / "train.csv", index=False)
    val.to_csv(tmp / "val.csv", index=False)
    return tmp


def _frame(labels: list[str], **cols: list[object]) -> pd.DataFrame:
    df = pd.DataFrame({"a": np.arange(len(labels), dtype=float), "b": np.ones(len(labels))} | cols)
    df["label"] = labels
    return df


def test_missing_label_column(tmp_path: Path) -> None:
    df = _frame(["x", "y"]).rename(columns={"label": "target"})
    with pytest.raises(DataError, match="train split has no label column 'label'"):
        load_data_dir(_write(tmp_path, df, df))


def test_non_numeric_feature_is_named(tmp_path: Path) -> None:
    df = _frame(["x", "y"], colour=["red", "blue"])
    with pytest.raises(DataError, match="feature column 'colour' in the train split is not numeric"):
        load_data_dir(_write(tmp_path, df, df))


def test_nan_and_inf_are_counted_with_their_column(tmp_path: Path) -> None:
    df = _frame(["x", "y", "x"], c=[1.0, np.nan, np.inf])
    with pytest.raises(
        DataError, match=r"feature column 'c' in the train split has 2 non-finite values \(1 NaN, 1 inf\)"
    ):
        load_data_dir(_write(tmp_path, df, _frame(["x", "y", "x"], c=[1.0, 2.0, 3.0])))


def test_class_in_validation_but_not_training(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"classes \['z'\] appear in the val split but not in training"):
        load_data_dir(_write(tmp_path, _frame(["x", "y"]), _frame(["x", "z"])))


def test_fewer_than_two_classes(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"training split has 1 class \(\['x'\]\); classification needs at least two"
    ):
        load_data_dir(_write(tmp_path, _frame(["x", "x"]), _frame(["x", "x"])))


def test_missing_split_file(tmp_path: Path) -> None:
    _frame(["x", "y"]).to_csv(tmp_path / "train.csv", index=False)
    with pytest.raises(DataError, match="has no val.parquet or val.csv"):
        load_data_dir(tmp_path)


def test_synth_is_long_tailed_balanced_in_eval_and_reproducible() -> None:
    spec = SynthSpec(
        n_classes=5, imbalance_ratio=50, n_max=500, n_val_per_class=10, n_test_per_class=20, seed=3
    )
    a, b = generate(spec), generate(spec)
    pd.testing.assert_frame_equal(a["train"], b["train"])
    sizes = a["train"]["label"].value_counts().sort_index().tolist()
    assert sizes == spec.class_sizes() and sizes[0] / sizes[-1] == 50
    assert set(a["val"]["label"].value_counts()) == {10}
    assert set(a["test"]["label"].value_counts()) == {20}


def test_synth_refuses_empty_rarest_class() -> None:
    with pytest.raises(ValueError, match="leaves the rarest class empty"):
        SynthSpec(n_max=50, imbalance_ratio=100)
