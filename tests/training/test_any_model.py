"""Any model on any labelled tensors: image folders, tensor shards, user factories, their refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from training.config import TrainConfig
from training.data_source import open_data
from training.datasets import SplitDataset
from training.datasets_builtin import write_topics_lt
from training.errors import DataError, ModelError
from training.factory import parse_model_args
from training.launch import train
from training.npy_rows import NpyRows


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skewserve", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def _images(
    root: Path, counts: dict[str, dict[str, int]], size: tuple[int, int] = (12, 10), mode: str = "L"
) -> Path:
    rng = np.random.default_rng(0)
    for split, per_class in counts.items():
        for cls, n in per_class.items():
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = 40 if cls == "a" else 200
                arr = np.clip(base + rng.normal(0, 20, (size[1], size[0], 3 if mode == "RGB" else 1)), 0, 255)
                Image.fromarray(arr.astype(np.uint8).squeeze(), mode=mode).save(folder / f"{i}.png")
    return root


def test_image_folders_train_the_cnn_family_and_record_the_contract(tmp_path: Path) -> None:
    data = _images(tmp_path / "img", {"train": {"a": 30, "b": 6}, "val": {"a": 8, "b": 8}})
    meta = train(
        TrainConfig(
            data_dir=data, out_dir=tmp_path / "art", model="cnn", model_args={"width": 8}, max_steps=20,
            global_batch_size=16, data_workers=1, progress=False,
        )
    )  # fmt: skip
    assert meta["inputs"] == [{"name": "image", "dtype": "uint8", "shape": [1, 10, 12]}]
    assert meta["model"] == {"kind": "builtin", "name": "cnn", "args": {"width": 8}}
    assert meta["metrics"]["val"]["balanced_accuracy"] > 0.9  # the classes differ in brightness


def test_mixed_sizes_and_modes_are_converted_and_reported(tmp_path: Path) -> None:
    data = _images(tmp_path / "img", {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}})
    _images(tmp_path / "img", {"train": {"c": 3}, "val": {"c": 1}}, size=(20, 20), mode="RGB")
    ds = open_data(data, image_size=16)
    assert ds.spec.inputs[0].shape == (3, 16, 16)  # one RGB class makes the set RGB
    assert any("converted to RGB and resized to 16x16" in w for w in ds.warnings)
    inputs, labels = SplitDataset(ds.val, ds.spec).__getitems__([0, 4])
    assert inputs[0].shape == (2, 3, 16, 16) and labels.tolist() == [0, 2]


def test_a_corrupt_image_is_named_or_skipped_and_counted(tmp_path: Path) -> None:
    data = _images(tmp_path / "img", {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}})
    (data / "train" / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(
        DataError, match=r"1 unreadable image\(s\) in .*train: .*broken.png .*--skip-bad-files"
    ):
        open_data(data)
    ds = open_data(data, skip_bad_files=True)
    assert len(ds.train) == 8 and "skipped unreadable images: {'train': 1}" in ds.warnings


def test_missing_and_singleton_classes_are_warned_and_unknown_ones_refused(tmp_path: Path) -> None:
    data = _images(tmp_path / "img", {"train": {"a": 4, "b": 1, "c": 3}, "val": {"a": 2, "b": 2}})
    ds = open_data(data)
    assert "classes with a single training item: ['b']; their recall will be noisy" in ds.warnings
    assert any("the val split has no items of classes ['c']" in w for w in ds.warnings)
    _images(tmp_path / "img", {"val": {"zz": 1}})
    with pytest.raises(DataError, match=r"class folders \['zz'\] appear in val/ but not in train/"):
        open_data(data)


def test_tensor_shards_stream_token_ids_with_lengths_into_the_text_family(tmp_path: Path) -> None:
    write_topics_lt(tmp_path / "t", n_max=120, ratio=6, val_per_class=10, test_per_class=10, max_length=20)
    ds = open_data(tmp_path / "t")
    (spec,) = ds.spec.inputs
    assert (spec.name, spec.dtype, spec.shape) == ("tokens", "int64", (-1,))
    assert spec.ranges[0][2] == 20 and 4 <= spec.ranges[0][1] <= 20
    assert isinstance(ds.train.arrays[0], NpyRows)  # rows are read on demand; labels held in memory
    inputs, _ = SplitDataset(ds.train, ds.spec).__getitems__([0, 1, 2])
    lengths = ds.train.lengths[0][:3]
    assert inputs[0].shape == (3, int(lengths.max()))  # padded to the batch's longest, not to 20
    meta = train(
        TrainConfig(
            data_dir=tmp_path / "t", out_dir=tmp_path / "art", model="text", model_args={"dim": 16, "heads": 2, "layers": 1},
            max_steps=30, global_batch_size=32, progress=False,
        )
    )  # fmt: skip
    assert meta["preprocessing"]["kind"] == "text" and len(meta["preprocessing"]["vocab"]) == 372


def test_a_factory_that_cannot_be_imported_is_refused_in_one_line(tmp_path: Path, small_data: Path) -> None:
    proc = _cli(
        "train", "--data", str(small_data), "--out", "a", "--model", "no_such_module:build", cwd=tmp_path
    )
    assert proc.returncode == 1
    assert (
        "error: cannot import model factory 'no_such_module:build': ModuleNotFoundError: No module named "
        "'no_such_module'. Check the module is on PYTHONPATH (or give a path to its .py file) and imports cleanly"
    ) in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_model_with_the_wrong_output_shape_is_refused_before_training(
    tmp_path: Path, small_data: Path
) -> None:
    (tmp_path / "mine.py").write_text(
        "from torch import nn\n\ndef build(data, hidden=4):\n    return nn.Sequential(nn.Linear(8, hidden), nn.Linear(hidden, 3))\n"
    )

    def train_mine(arg: str) -> subprocess.CompletedProcess[str]:
        args = ["train", "--data", str(small_data), "--out", "a", "--model", "mine:build", "--model-arg", arg]
        return _cli(*args, cwd=tmp_path)

    proc = train_mine("hidden=6")
    assert proc.returncode == 1
    assert (
        "error: model 'mine:build' returned float32 [4, 3] for a batch of features [4, 8] float32; it must "
        "return float logits shaped [batch, classes] = [4, 5]"
    ) in proc.stdout
    proc = train_mine("depth=2")
    assert "error: model factory 'mine:build' refused its arguments {'depth': 2}" in proc.stdout
    assert "it accepts ['hidden']" in proc.stdout


def test_model_args_are_read_as_json_values() -> None:
    assert parse_model_args(["width=64", "dropout=0.2", "name=wide", "flag=true"]) == {
        "width": 64, "dropout": 0.2, "name": "wide", "flag": True,
    }  # fmt: skip
    with pytest.raises(ModelError, match="--model-arg 'width' must be KEY=VALUE"):
        parse_model_args(["width"])


def test_npy_rows_read_exactly_what_numpy_stored_and_refuse_what_they_cannot(tmp_path: Path) -> None:
    import pickle

    for dtype in ("float16", "int32", "uint8", "bool"):
        x = (np.arange(5 * 2 * 3).reshape(5, 2, 3) % 7).astype(dtype)
        np.save(tmp_path / f"{dtype}.npy", x)
        rows = NpyRows(tmp_path / f"{dtype}.npy")
        np.testing.assert_array_equal(rows.rows(1, 4), x[1:4])
        np.testing.assert_array_equal(
            pickle.loads(pickle.dumps(rows)).row(4), x[4]
        )  # as a spawned worker gets it
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((3, 2))))
    with pytest.raises(ValueError, match="is stored in Fortran order; save it C-ordered"):
        NpyRows(tmp_path / "f.npy")
    full = (tmp_path / "uint8.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(full[:-4])
    with pytest.raises(OSError, match=r"cut.npy: short read at row 4 \(the file is truncated\)"):
        NpyRows(tmp_path / "cut.npy").row(4)


def test_val_fraction_splits_a_table_and_export_reproduces_the_split(
    tmp_path: Path, small_data: Path
) -> None:
    """Issue 25 item 11 and 7: no val file needed; export finds the same validation rows from anywhere."""
    import shutil

    import pandas as pd

    data = tmp_path / "only-train"
    data.mkdir()
    shutil.copy(small_data / "train.parquet", data / "train.parquet")
    proc = _cli(
        "train", "--data", str(data), "--out", "art", "--val-fraction", "0.2", "--epochs", "2", "--width", "16",
        "--seed", "3", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = __import__("json").loads((tmp_path / "art" / "metadata.json").read_text())
    assert meta["provenance"]["val_fraction"] == 0.2 and Path(meta["provenance"]["data_dir"]).is_absolute()
    rows = len(pd.read_parquet(data / "train.parquet"))
    ds = open_data(data, val_fraction=0.2, seed=3)
    assert len(ds.val) + len(ds.train) == rows and abs(len(ds.val) - 0.2 * rows) <= 5
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    export = _cli(
        "export",
        "--artifact",
        str(tmp_path / "art"),
        "--repo",
        "repo",
        "--name",
        "t",
        "--tensorrt",
        "off",
        cwd=elsewhere,
    )
    assert export.returncode == 0, export.stdout + export.stderr
    assert f"over {len(ds.val)} rows" in export.stdout and "weakened" not in export.stdout


def test_export_says_when_the_parity_gate_falls_back_to_synthetic_rows(
    tmp_path: Path, small_artifact: Path
) -> None:
    import json
    import shutil

    art = tmp_path / "moved"
    shutil.copytree(small_artifact, art)
    meta = json.loads((art / "metadata.json").read_text())
    meta["provenance"]["data_dir"] = str(tmp_path / "gone")
    (art / "metadata.json").write_text(json.dumps(meta))
    export = _cli(
        "export", "--artifact", str(art), "--repo", "repo", "--name", "t", "--tensorrt", "off", cwd=tmp_path
    )
    assert export.returncode == 0, export.stdout + export.stderr
    assert "notice: parity gate weakened: validation data at " in export.stdout
    assert "parity used" in export.stdout and "synthetic rows only" in export.stdout
