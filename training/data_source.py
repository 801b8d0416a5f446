"""Open any supported data directory as LabelledData: tables, image folders or tensor shards."""

from __future__ import annotations

from pathlib import Path

from training.datasets import LabelledData, detect_format


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
    """Detect the layout (README, 'Bring your own data') and open it; DataError names what is wrong."""
    kind = detect_format(Path(data_dir))
    if kind == "table":
        from training.data import open_table

        return open_table(data_dir, label, val_fraction, seed)
    if kind == "tensors":
        from training.shards import open_shards

        return open_shards(data_dir)
    from training.images import open_images

    return open_images(data_dir, image_size, channels, augment, skip_bad_files)
