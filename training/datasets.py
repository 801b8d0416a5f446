"""Labelled data of any kind behind one interface: splits that hold only labels in memory.

A split is a map-style torch Dataset whose `__getitems__` (the batched fetch torch's DataLoader
calls when a dataset has one) turns a list of indices into one batch: a tuple of input tensors in
the DataSpec's order, and the labels. Items with a dynamic dimension are padded with zeros to the
longest in the batch. The class-balanced sampler and the rank-speed balancer choose indices, so a
batch of any structure is split across ranks before anything is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from training.data_spec import DataSpec
from training.errors import DataError

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class Split(Protocol):
    """One split: labels as int64 class indices, items read on demand."""

    @property
    def labels(self) -> np.ndarray: ...

    def __len__(self) -> int: ...

    def item(self, index: int) -> tuple[np.ndarray, ...]: ...


class SplitDataset(torch.utils.data.Dataset[Batch]):
    """A split as a DataLoader dataset: batched fetch, zero-padding of dynamic dimensions."""

    def __init__(self, split: Split, spec: DataSpec) -> None:
        self.split = split
        self.spec = spec

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> Batch:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        batched = getattr(self.split, "items", None)
        if batched is not None:  # tables gather whole batches at once
            arrays: tuple[np.ndarray, ...] = batched(np.asarray(indices, dtype=np.int64))
        else:
            rows = [self.split.item(int(i)) for i in indices]
            arrays = tuple(stack_padded([r[k] for r in rows]) for k in range(len(self.spec.inputs)))
        labels = torch.from_numpy(
            np.ascontiguousarray(self.split.labels[np.asarray(indices, dtype=np.int64)])
        )
        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays), labels


def stack_padded(items: list[np.ndarray]) -> np.ndarray:
    """Stack items whose shapes differ only in dynamic dimensions, zero-padding each to the largest."""
    first = items[0]
    if all(x.shape == first.shape for x in items):
        return np.stack(items)
    shape = tuple(max(x.shape[d] for x in items) for d in range(first.ndim))
    out = np.zeros((len(items), *shape), dtype=first.dtype)
    for i, x in enumerate(items):
        out[(i, *(slice(0, n) for n in x.shape))] = x
    return out


def identity_collate(batch: Any) -> Any:
    """The DataLoader's collate step: `__getitems__` already built the batch."""
    return batch


@dataclass(frozen=True)
class LabelledData:
    """Train/val(/test) splits of one data set, its DataSpec and a content hash for provenance."""

    spec: DataSpec
    train: Split
    val: Split
    test: Split | None
    data_hash: str
    warnings: tuple[str, ...] = ()

    @property
    def classes(self) -> list[str]:
        return list(self.spec.classes)

    @property
    def class_counts(self) -> np.ndarray:
        return np.bincount(self.train.labels, minlength=len(self.spec.classes))

    def splits(self) -> dict[str, Split]:
        return {
            "train": self.train,
            "val": self.val,
            **({"test": self.test} if self.test is not None else {}),
        }


def detect_format(data_dir: Path) -> str:
    """table (train.csv/.parquet), tensors (train/labels.npy) or images (train/<class>/<files>)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist")
    if any((data_dir / f"train{ext}").is_file() for ext in (".parquet", ".csv")):
        return "table"
    if (data_dir / "train" / "labels.npy").is_file():
        return "tensors"
    if (data_dir / "train").is_dir():
        return "images"
    raise DataError(
        f"{data_dir} holds no data set: expected train.csv/train.parquet (tables), train/labels.npy "
        "with one .npy per input (tensor shards), or train/<class>/<images> (image folders); "
        "see docs/models-and-data.md#bring-your-own-data"
    )


def class_warnings(labels_by_split: dict[str, np.ndarray], classes: Sequence[str]) -> list[str]:
    """Warnings for classes a split lacks and for classes with a single training item."""
    out = []
    train = np.bincount(labels_by_split["train"], minlength=len(classes))
    single = [classes[i] for i in np.flatnonzero(train == 1)]
    if single:
        out.append(f"classes with a single training item: {single}; their recall will be noisy")
    for name, labels in labels_by_split.items():
        if name == "train":
            continue
        counts = np.bincount(labels, minlength=len(classes))
        missing = [classes[i] for i in np.flatnonzero(counts == 0)]
        if missing:
            out.append(
                f"the {name} split has no items of classes {missing}: its balanced accuracy covers only "
                "the classes it holds"
            )
    return out
