"""Image preprocessing, the one implementation used in training and in Triton's raw-bytes step.

Standalone on purpose (numpy and Pillow only): the exporter copies this file beside the Python
backend model that decodes PNG/JPEG bytes for the ensemble, so served raw images get exactly the
pixels training saw. Output: uint8 [channels, height, width]; scaling and mean/std live in the
model, so the served tensor is the compact uint8 image.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

MODES = {1: "L", 3: "RGB"}


def to_array(image: Image.Image, channels: int, size: tuple[int, int]) -> np.ndarray:
    """Any mode and size -> uint8 [C, H, W]: converted to L or RGB, resized bilinear to (H, W)."""
    if image.mode in ("RGBA", "LA", "P") and channels == 3:
        # Transparent pixels composite onto black, as training's conversion does for every file.
        image = image.convert("RGBA")
    image = image.convert(MODES[channels])
    height, width = size
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    arr = np.asarray(image, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def decode(data: bytes, channels: int, size: tuple[int, int]) -> np.ndarray:
    """Encoded PNG or JPEG bytes -> uint8 [C, H, W]; ValueError names what could not be read."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return to_array(image, channels, size)
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"cannot decode image ({len(data)} bytes): {exc}") from exc


def load(path: Path, channels: int, size: tuple[int, int]) -> np.ndarray:
    with Image.open(path) as image:
        image.load()
        return to_array(image, channels, size)
