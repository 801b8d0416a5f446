"""Raw images preprocessed by Triton exactly as training read them: `<name>_preprocess` (the Python
backend model the exporter publishes) called directly on a real tritonserver, over a folder that
mixes sizes and L, RGB, RGBA, palette and JPEG files, for a 1-channel and a 3-channel model; its
output equals the training loader's batches (augmentation off) array for array."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image

from exporter.pipeline import export_artifact
from skewserve.triton_dist import PreparedTriton
from tests.gateway.conftest import start_fleet, stop_fleet
from training.config import TrainConfig
from training.data_source import open_configured
from training.datasets import SplitDataset
from training.launch import train

pytestmark = pytest.mark.slow
# (mode, size, format): every way a user's folder differs from the size and mode the model reads.
KINDS = [
    ("L", (12, 12), "PNG"),
    ("RGB", (20, 14), "PNG"),
    ("RGBA", (9, 16), "PNG"),
    ("P", (16, 16), "PNG"),
    ("RGB", (17, 11), "JPEG"),
    ("L", (8, 30), "JPEG"),
    ("LA", (15, 15), "PNG"),
]


def _image(rng: np.random.Generator, mode: str, size: tuple[int, int], label: int) -> Image.Image:
    """A picture whose class shows in its pixels (brighter with the label), with noise."""
    w, h = size
    base = rng.integers(0, 80, (h, w, 4), dtype=np.uint8) + np.uint8(40 * label)
    rgba = Image.fromarray(base, "RGBA")
    if mode == "RGBA":
        alpha = rng.integers(0, 256, (h, w), dtype=np.uint8)  # transparent pixels must convert alike
        rgba.putalpha(Image.fromarray(alpha, "L"))
        return rgba
    if mode == "P":
        return rgba.convert("RGB").quantize(colors=16)
    return rgba.convert(mode)


def _folder(root: Path) -> Path:
    rng = np.random.default_rng(7)
    for split, n in (("train", 12), ("val", 4), ("test", 4)):
        for label in range(3):
            d = root / split / f"c{label}"
            d.mkdir(parents=True)
            for i in range(n):
                mode, size, fmt = KINDS[(i + label) % len(KINDS)]
                image = _image(rng, mode, size, label)
                image.save(d / f"{i}.{'jpg' if fmt == 'JPEG' else 'png'}", format=fmt)
    return root


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _folder(tmp_path_factory.mktemp("mixed_images"))


@pytest.fixture(scope="module")
def exported(
    mixed_folder: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[tuple[dict[int, TrainConfig], str]]:
    work = tmp_path_factory.mktemp("raw_pre")
    repo = work / "repo"
    configs = {}
    for channels in (1, 3):
        cfg = TrainConfig(
            data_dir=mixed_folder,
            out_dir=work / f"art{channels}",
            model="cnn",
            channels=channels,
            image_size=10,
            max_steps=2,
            global_batch_size=8,
            progress=False,
        )
        train(cfg)
        export_artifact(cfg.out_dir, repo, f"img{channels}", tensorrt="off")
        configs[channels] = cfg
    fleet = start_fleet(repo, {"us-east": 1}, work / "logs", prepared_triton)
    try:
        yield configs, fleet["us-east"][0].http_address
    finally:
        stop_fleet(fleet)


@pytest.mark.parametrize("channels", [1, 3])
def test_tritons_preprocess_step_equals_the_training_loaders_batches(exported, channels: int) -> None:
    configs, address = exported
    cfg = configs[channels]
    meta = json.loads((cfg.out_dir / "metadata.json").read_text())
    assert meta["preprocessing"]["channels"] == channels and meta["preprocessing"]["size"] == [10, 10]
    data = open_configured(cfg, augment=False)
    client = httpclient.InferenceServerClient(address)
    held_out = [data.val, data.test]
    kinds = set()
    for split in held_out:
        assert split is not None
        for p in split.paths:
            with Image.open(p) as im:
                kinds.add((im.mode, im.format, im.size))
    assert {m for m, f, _ in kinds if f == "PNG"} >= {"L", "RGB", "RGBA", "P"}
    assert {m for m, f, _ in kinds if f == "JPEG"} >= {"L", "RGB"} and len({s for *_, s in kinds}) >= 5
    for split in held_out:
        (want,), _ = SplitDataset(split, data.spec).__getitems__(list(range(len(split))))
        raw = np.array([[p.read_bytes()] for p in split.paths], dtype=object)
        t = httpclient.InferInput("raw", [len(split.paths), 1], "BYTES")
        t.set_data_from_numpy(raw)
        got = client.infer(f"img{channels}_preprocess", [t]).as_numpy("image")
        assert got.dtype == np.uint8 and got.shape == (len(split.paths), channels, 10, 10)
        np.testing.assert_array_equal(got, want.numpy())
