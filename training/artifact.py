"""The training artifact: weights + metadata.json (the contract with the exporter) + metrics.

The directory is assembled under a temporary name and renamed into place; readers treat a
directory without metadata.json as incomplete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.model import MLPClassifier, ModelSpec

FORMAT_VERSION = 1
WEIGHTS_NAME = "model.pt"


def write_artifact(
    out_dir: Path,
    model: MLPClassifier,
    metadata: dict[str, Any],
    metrics: dict[str, Any],
    classes: list[str],
) -> Path:
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        torch.save(model.state_dict(), staging / WEIGHTS_NAME)
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2))
        cm_source = metrics.get("test") or metrics["val"]
        plot_confusion(np.asarray(cm_source["confusion_matrix"]), classes, staging / "confusion_matrix.png")
        (staging / "metadata.json").write_text(json.dumps(metadata, indent=2))
        # Keep checkpoints and monitor logs of the run, swap only the artifact files.
        out_dir.mkdir(parents=True, exist_ok=True)
        for item in staging.iterdir():
            if item.name != "metadata.json":
                os.replace(item, out_dir / item.name)
        os.replace(staging / "metadata.json", out_dir / "metadata.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def plot_confusion(cm: np.ndarray, classes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    norm = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(1.0 + 0.5 * len(classes), 1.0 + 0.45 * len(classes)))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(classes)), classes, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(classes)), classes, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion (row-normalised recall)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_metadata(artifact_dir: Path) -> dict[str, Any]:
    path = Path(artifact_dir) / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{artifact_dir} is not a complete artifact: metadata.json is missing (train first)"
        )
    meta: dict[str, Any] = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"artifact format_version {meta.get('format_version')} is not supported (expected {FORMAT_VERSION})"
        )
    return meta


def load_model(artifact_dir: Path) -> tuple[MLPClassifier, dict[str, Any]]:
    """Rebuild the trained module (eval mode) and its metadata from an artifact directory."""
    meta = read_metadata(artifact_dir)
    spec = ModelSpec(**meta["model"]["hyperparameters"])
    model = MLPClassifier(spec)
    state = torch.load(Path(artifact_dir) / WEIGHTS_NAME, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    return model, meta
