"""The training artifact: weights + metadata.json (the contract with the exporter) + metrics.

The directory is assembled under a temporary name and renamed into place; readers treat a
directory without metadata.json as incomplete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from training.data_spec import DataSpec

# 2: any model (its factory and arguments), any inputs (tensor specs), preprocessing. 1: the MLP only.
FORMAT_VERSION = 2
WEIGHTS_NAME = "model.pt"
logger = logging.getLogger(__name__)


def write_artifact(
    out_dir: Path,
    model: nn.Module,
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


def _upgrade_v1(meta: dict[str, Any]) -> dict[str, Any]:
    """A format-1 artifact (the tabular MLP) in format 2's terms, so older artifacts still export."""
    names = [i["name"] for i in meta["inputs"]]
    hyper = dict(meta["model"]["hyperparameters"])
    return meta | {
        "format_version": FORMAT_VERSION,
        "model": {
            "kind": "builtin",
            "name": "mlp",
            "args": {k: hyper[k] for k in ("width", "depth", "dropout")},
        },
        "data_kind": "table",
        "inputs": [{"name": "features", "dtype": "float32", "shape": [len(names)]}],
        "preprocessing": {"feature_names": names} | meta["normalisation"],
    }


def read_metadata(artifact_dir: Path) -> dict[str, Any]:
    path = Path(artifact_dir) / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{artifact_dir} is not a complete artifact: metadata.json is missing (train first)"
        )
    meta: dict[str, Any] = json.loads(path.read_text())
    if meta.get("format_version") == 1:
        return _upgrade_v1(meta)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"artifact format_version {meta.get('format_version')} is not supported (expected {FORMAT_VERSION})"
        )
    return meta


def data_spec(meta: dict[str, Any]) -> DataSpec:
    """The DataSpec the model's factory was called with, from the artifact's metadata."""
    return DataSpec.from_dict(
        {
            "kind": meta["data_kind"],
            "inputs": meta["inputs"],
            "classes": meta["classes"],
            "class_counts": meta["class_counts"],
            "preprocessing": meta.get("preprocessing", {}),
        }
    )


def load_model(artifact_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the trained module (eval mode) through its factory, and load its weights."""
    from training.errors import ModelError
    from training.factory import build, resolve

    meta = read_metadata(artifact_dir)
    source = meta["model"]
    name = source.get("name", "mlp")
    _, now = resolve(name)
    if source.get("sha256") and now.get("sha256") != source["sha256"]:
        logger.warning(
            "model factory %s: its module file changed since training (sha256 %s, now %s)",
            name,
            str(source["sha256"])[:12],
            str(now.get("sha256"))[:12],
        )
    model, _ = build(name, dict(source.get("args", {})), data_spec(meta))
    state = torch.load(Path(artifact_dir) / WEIGHTS_NAME, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ModelError(
            f"the weights in {artifact_dir} do not fit the model {name!r} builds now: {str(exc).splitlines()[0]}; "
            "restore the factory as it was at training time, or train again"
        ) from exc
    model.eval()
    return model, meta
