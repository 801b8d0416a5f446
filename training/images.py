"""Image-folder data sets: `train/`, `val/`, optional `test/`, one sub-folder per class (PNG, JPEG).

Only paths and labels are held in memory; images are decoded, converted to a fixed channel count
and resized in DataLoader workers (`training.image_preprocess`, the same code Triton's raw-bytes
step runs). Every file's header is read once up front, so an unreadable file is named before the
first step (or skipped and counted with `skip_bad_files`) and mixed sizes and modes are reported.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from training import image_preprocess
from training.data_spec import DataSpec, InputSpec
from training.datasets import LabelledData, class_warnings
from training.errors import DataError

logger = logging.getLogger(__name__)
EXTENSIONS = {".png", ".jpg", ".jpeg"}
STATS_SAMPLE = 256  # images decoded to estimate the per-channel mean and std


# Decoded images each DataLoader worker keeps: a small data set is decoded once per worker, not
# once per epoch; a large one streams (the cache stops growing at this many bytes per process).
DECODED_CACHE_BYTES = 128 << 20


@dataclass
class ImageSplit:
    paths: list[Path]
    labels: np.ndarray
    channels: int
    size: tuple[int, int]
    augment: bool = False
    shift: int = field(init=False)
    cache_bytes: int = DECODED_CACHE_BYTES
    _decoded: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)
    _held: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.shift = max(1, min(self.size) // 8)

    def __len__(self) -> int:
        return len(self.paths)

    def item(self, index: int) -> tuple[np.ndarray, ...]:
        arr = self._decoded.get(index)
        if arr is None:
            path = self.paths[index]
            try:
                arr = image_preprocess.load(path, self.channels, self.size)
            except (OSError, ValueError) as exc:
                raise DataError(f"cannot decode image {path}: {exc}") from exc
            if self._held + arr.nbytes <= self.cache_bytes:
                self._decoded[index] = arr
                self._held += arr.nbytes
        if self.augment:
            arr = _random_shift(arr, self.shift)
        return (arr,)


def _random_shift(arr: np.ndarray, shift: int) -> np.ndarray:
    """Translate by up to `shift` pixels each way, zero-filled: label-preserving for any image class."""
    dy, dx = (int(v) for v in torch.randint(-shift, shift + 1, (2,)))
    out = np.zeros_like(arr)
    h, w = arr.shape[1:]
    out[:, max(0, dy) : h + min(0, dy), max(0, dx) : w + min(0, dx)] = arr[
        :, max(0, -dy) : h - max(0, dy), max(0, -dx) : w - max(0, dx)
    ]
    return out


def _scan(split_dir: Path, skip_bad: bool) -> tuple[list[tuple[Path, str]], list[str], Counter[str]]:
    """(file, class) pairs with a readable image header, the bad files, and a count of size/mode."""
    found: list[tuple[Path, str]] = []
    bad: list[str] = []
    shapes: Counter[str] = Counter()
    for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        for path in sorted(class_dir.iterdir()):
            if path.suffix.lower() not in EXTENSIONS or not path.is_file():
                continue
            try:
                with Image.open(path) as im:
                    shapes[f"{im.size[0]}x{im.size[1]} {im.mode}"] += 1
                    im.verify()
            except Exception as exc:  # PIL raises many types for a bad file; each is a bad file
                bad.append(f"{path} ({type(exc).__name__}: {exc})")
                continue
            found.append((path, class_dir.name))
    if bad and not skip_bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise DataError(
            f"{len(bad)} unreadable image(s) in {split_dir}: {'; '.join(bad[:5])}{more}. "
            "Remove them, or pass --skip-bad-files to train without them (they are counted)"
        )
    return found, bad, shapes


def open_images(
    data_dir: Path,
    image_size: int | None = None,
    channels: int | None = None,
    augment: bool = True,
    skip_bad_files: bool = False,
) -> LabelledData:
    data_dir = Path(data_dir)
    scanned = {}
    for split in ("train", "val", "test"):
        if (data_dir / split).is_dir():
            scanned[split] = _scan(data_dir / split, skip_bad_files)
        elif split != "test":
            raise DataError(f"{data_dir} has no {split}/ folder (image data sets need train/ and val/)")
    classes = sorted({c for _, c in scanned["train"][0]})
    if len(classes) < 2:
        raise DataError(
            f"{data_dir / 'train'} has images in {len(classes)} class folder(s); classification needs two"
        )
    index = {c: i for i, c in enumerate(classes)}
    for split, (files, _, _) in scanned.items():
        unknown = sorted({c for _, c in files} - set(index))
        if unknown:
            raise DataError(
                f"class folders {unknown} appear in {split}/ but not in train/; the model cannot predict "
                "them: add training images for them or remove the folders"
            )
    shapes = scanned["train"][2]
    if channels is None:  # all grey -> 1 channel, otherwise RGB
        channels = 1 if all(k.endswith((" L", " 1", " I;16", " I")) for k in shapes) else 3
    if channels not in image_preprocess.MODES:
        raise DataError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
    if image_size is None:
        (common, _), *_ = shapes.most_common(1)
        w, h = (int(v) for v in common.split()[0].split("x"))
        size = (h, w)
    else:
        size = (image_size, image_size)
    notes = []
    if len(shapes) > 1:
        notes.append(
            f"images of {len(shapes)} sizes/modes ({', '.join(f'{k}: {n}' for k, n in shapes.most_common(4))}); "
            f"each is converted to {image_preprocess.MODES[channels]} and resized to {size[1]}x{size[0]}"
        )
    skipped = {s: len(bad) for s, (_, bad, _) in scanned.items() if bad}
    if skipped:
        notes.append(f"skipped unreadable images: {skipped}")
    splits = {
        s: ImageSplit(
            [p for p, _ in files],
            np.asarray([index[c] for _, c in files], dtype=np.int64),
            channels,
            size,
            augment=augment and s == "train",
        )
        for s, (files, _, _) in scanned.items()
    }
    mean, std = _channel_stats(splits["train"])
    digest = hashlib.sha256()
    for s, sp in splits.items():
        for p, y in zip(sp.paths, sp.labels, strict=True):
            digest.update(f"{s}/{p.relative_to(data_dir)}:{p.stat().st_size}:{y}\n".encode())
    train_counts = np.bincount(splits["train"].labels, minlength=len(classes))
    spec = DataSpec(
        kind="images",
        inputs=(InputSpec("image", "uint8", (channels, *size)),),
        classes=tuple(classes),
        class_counts=tuple(int(c) for c in train_counts),
        preprocessing={
            "kind": "image",
            "channels": channels,
            "size": list(size),
            "mean": mean,
            "std": std,
            "resize": "bilinear",
            "augment": "random shift" if augment else "off",
        },
    )
    warnings = tuple(notes + class_warnings({s: sp.labels for s, sp in splits.items()}, classes))
    return LabelledData(
        spec, splits["train"], splits["val"], splits.get("test"), digest.hexdigest(), warnings
    )


def _channel_stats(split: ImageSplit) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of pixel values in [0, 1] over a fixed sample of training images."""
    rng = np.random.default_rng(0)
    pick = rng.choice(len(split), size=min(STATS_SAMPLE, len(split)), replace=False)
    pixels = np.stack([image_preprocess.load(split.paths[i], split.channels, split.size) for i in pick])
    x = pixels.astype(np.float64) / 255.0
    mean = x.mean(axis=(0, 2, 3))
    std = np.maximum(x.std(axis=(0, 2, 3)), 1e-3)
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]
