"""Tensor-shard data sets: memory-mapped `.npy` arrays of any shape and dtype, plus labels.

    DATA/classes.txt             optional: class names, one a line (label i is line i)
    DATA/vocab.txt               optional: words of a text vocabulary, one a line (ids from 2)
    DATA/<split>/labels.npy      int labels, one per item; split is train, val or optional test
    DATA/<split>/<input>.npy     one array per model input, first axis = items
    DATA/<split>/<input>.lengths.npy  optional: valid length of each item's first axis

Inputs are taken in name order. An input with lengths has a dynamic first dimension: item i is
`array[i, :lengths[i]]`, and a batch is zero-padded to its longest item (token ids with lengths,
audio frames). Inputs are read row by row with positioned reads (`training.npy_rows`): only the
labels and lengths are read into memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.data_spec import DYNAMIC, TRITON_DTYPES, DataSpec, InputSpec
from training.datasets import LabelledData, class_warnings
from training.errors import DataError
from training.npy_rows import NpyRows

HASH_PREFIX_BYTES = 1 << 20


@dataclass
class ShardSplit:
    arrays: list[NpyRows]
    lengths: list[np.ndarray | None]
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def item(self, index: int) -> tuple[np.ndarray, ...]:
        out = []
        for arr, lengths in zip(self.arrays, self.lengths, strict=True):
            row = arr.row(index)
            out.append(row if lengths is None else row[: int(lengths[index])])
        return tuple(out)


def _input_names(split_dir: Path) -> list[str]:
    return sorted(
        p.name[: -len(".npy")]
        for p in split_dir.glob("*.npy")
        if p.name != "labels.npy" and not p.name.endswith(".lengths.npy")
    )


def _open_split(split_dir: Path, names: list[str]) -> ShardSplit:
    try:
        labels = np.load(split_dir / "labels.npy")
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {split_dir / 'labels.npy'}: {exc}") from exc
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{split_dir / 'labels.npy'} must be a 1-d integer array, got shape {labels.shape} dtype {labels.dtype}"
        )
    arrays, lengths = [], []
    for name in names:
        path = split_dir / f"{name}.npy"
        try:
            arr = NpyRows(path)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {path}: {exc}") from exc
        if arr.shape[:1] != labels.shape:
            raise DataError(
                f"{path} has {arr.shape[0] if arr.ndim else 0} items but labels.npy has {len(labels)}"
            )
        if arr.dtype.name not in TRITON_DTYPES:
            raise DataError(f"{path} has dtype {arr.dtype}; supported: {', '.join(TRITON_DTYPES)}")
        lpath = split_dir / f"{name}.lengths.npy"
        lens = np.load(lpath) if lpath.is_file() else None
        if lens is not None:
            if arr.ndim < 2 or lens.shape != labels.shape:
                raise DataError(f"{lpath} needs one length per item of a >= 2-d {name}.npy")
            if len(lens) and (lens.min() < 1 or lens.max() > arr.shape[1]):
                raise DataError(
                    f"{lpath} has lengths in [{lens.min()}, {lens.max()}]; each must be within [1, {arr.shape[1]}]"
                )
        arrays.append(arr)
        lengths.append(lens)
    return ShardSplit(arrays, lengths, labels.astype(np.int64))


def _max_id(arrays: list[NpyRows], chunk: int = 1 << 12) -> int:
    """Largest value of integer arrays, read in chunks (never the whole file at once)."""
    top = 0
    for arr in arrays:
        for start in range(0, len(arr), chunk):
            part = arr.rows(start, start + chunk)
            if part.size:
                top = max(top, int(part.max()))
    return top


def open_shards(data_dir: Path) -> LabelledData:
    data_dir = Path(data_dir)
    names = _input_names(data_dir / "train")
    if not names:
        raise DataError(f"{data_dir / 'train'} has labels.npy but no input arrays (<name>.npy)")
    splits = {"train": _open_split(data_dir / "train", names)}
    for split in ("val", "test"):
        if (data_dir / split / "labels.npy").is_file():
            other = _input_names(data_dir / split)
            if other != names:
                raise DataError(f"{data_dir / split} has inputs {other}; train has {names}: they must match")
            splits[split] = _open_split(data_dir / split, names)
        elif split == "val":
            raise DataError(f"{data_dir} has no val/labels.npy (tensor shards need train/ and val/)")
    train = splits["train"]
    inputs = []
    for k, name in enumerate(names):
        arr, lens = train.arrays[k], train.lengths[k]
        item_shape = tuple(arr.shape[1:])
        ranges: tuple[tuple[int, int, int], ...] = ()
        if lens is not None:
            item_shape = (DYNAMIC, *item_shape[1:])
            ranges = ((int(lens.min()), int(np.median(lens)), int(arr.shape[1])),)
        for split, sp in splits.items():
            if (
                sp.arrays[k].dtype != arr.dtype
                or sp.arrays[k].shape[1 + (lens is not None) :] != arr.shape[1 + (lens is not None) :]
            ):
                raise DataError(
                    f"{split}/{name}.npy has dtype {sp.arrays[k].dtype} shape {sp.arrays[k].shape[1:]} per item; "
                    f"train has {arr.dtype} {arr.shape[1:]}"
                )
        inputs.append(InputSpec(name, arr.dtype.name, item_shape, ranges))
    top = max(int(sp.labels.max(initial=0)) for sp in splits.values())
    classes_file = data_dir / "classes.txt"
    if classes_file.is_file():
        classes = [c for c in classes_file.read_text().splitlines() if c.strip()]
        if top >= len(classes):
            raise DataError(f"labels go up to {top} but classes.txt names {len(classes)} classes")
    else:
        classes = [str(i) for i in range(top + 1)]
    if min(int(sp.labels.min(initial=0)) for sp in splits.values()) < 0:
        raise DataError("labels.npy holds negative labels; labels are class indices 0..n-1")
    counts = np.bincount(train.labels, minlength=len(classes))
    if (counts > 0).sum() < 2:
        raise DataError(
            f"the train split has items of {(counts > 0).sum()} class(es); classification needs two"
        )
    preprocessing: dict[str, object] = {
        "max_id": {
            s.name: _max_id([sp.arrays[k] for sp in splits.values()])
            for k, s in enumerate(inputs)
            if np.issubdtype(np.dtype(s.dtype), np.integer) and s.dtype != "uint8"
        }
    }
    vocab_file = data_dir / "vocab.txt"
    if vocab_file.is_file():
        words = [w for w in vocab_file.read_text(encoding="utf-8").splitlines() if w]
        text_inputs = [s.name for s in inputs if s.shape[:1] == (DYNAMIC,) and s.dtype in ("int64", "int32")]
        if text_inputs:
            preprocessing |= {
                "kind": "text",
                "input": text_inputs[0],
                "vocab": words,
                "max_length": int(train.arrays[names.index(text_inputs[0])].shape[1]),
            }
    h = hashlib.sha256()
    for split in splits:
        for p in sorted((data_dir / split).glob("*.npy")):
            h.update(f"{split}/{p.name}:{p.stat().st_size}\n".encode())
            with open(p, "rb") as f:
                h.update(f.read(HASH_PREFIX_BYTES))
    spec = DataSpec(
        kind="tensors",
        inputs=tuple(inputs),
        classes=tuple(classes),
        class_counts=tuple(int(c) for c in counts),
        preprocessing=preprocessing,
    )
    warnings = tuple(class_warnings({s: sp.labels for s, sp in splits.items()}, classes))
    return LabelledData(spec, train, splits["val"], splits.get("test"), h.hexdigest(), warnings)
