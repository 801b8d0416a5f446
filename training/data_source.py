"""Open any supported data directory as LabelledData: tables, image folders or tensor shards."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from training.datasets import LabelledData, detect_format

if TYPE_CHECKING:
    from training.config import TrainConfig


def open_data(
    data_dir: Path,
    label: str = "label",
    image_size: int | None = None,
    channels: int | None = None,
    augment: bool = True,
    skip_bad_files: bool = False,
    val_fraction: float | None = None,
    seed: int = 0,
) -> LabelledData:
    """Detect the layout (docs/models-and-data.md#bring-your-own-data) and open it; DataError names what is wrong."""
    kind = detect_format(Path(data_dir))
    if kind == "table":
        from training.data import open_table

        return open_table(data_dir, label, val_fraction, seed)
    if kind == "tensors":
        from training.shards import open_shards

        return open_shards(data_dir)
    from training.images import open_images

    return open_images(data_dir, image_size, channels, augment, skip_bad_files)


def open_configured(cfg: TrainConfig, augment: bool | None = None) -> LabelledData:
    """The data a training config names, read as its workers read it (`augment` overrides the config's)."""
    return open_data(
        cfg.data_dir,
        cfg.label_column,
        cfg.image_size,
        cfg.channels,
        cfg.augment if augment is None else augment,
        cfg.skip_bad_files,
        cfg.val_fraction,
        cfg.seed,
    )
