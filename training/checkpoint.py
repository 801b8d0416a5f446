"""Atomic checkpoints: written to a temporary file, fsynced and renamed, so a crash leaves the old one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from training.errors import CheckpointError

CHECKPOINT_NAME = "last.pt"


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    tmp = directory / f".{CHECKPOINT_NAME}.tmp-{os.getpid()}"
    for stale in directory.glob(f".{CHECKPOINT_NAME}.tmp-*"):
        if stale != tmp:  # left by a process killed mid-save; only rank 0 of one run writes here
            stale.unlink(missing_ok=True)
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: Path) -> dict[str, Any] | None:
    path = directory / CHECKPOINT_NAME
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a checkpoint we cannot read must stop a resume, not be skipped
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); delete it to start over") from exc
    if "epoch" not in state or "model" not in state:
        raise CheckpointError(f"checkpoint {path} lacks epoch/model entries; delete it to start over")
    return state
