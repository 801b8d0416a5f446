"""Atomic checkpoints: written to a temporary file, fsynced and renamed, so a crash leaves the old one.

The directory may be shared between nodes (NFS, a cluster file system). Only global rank 0 writes
(the worker's rule); the temporary name carries host and pid so writers of different jobs or a
writer that died mid-write never collide, and the directory is fsynced after the rename so the new
name survives a crash of the writer's node. Readers only ever open `last.pt`, never a temporary.
Resume works whether the directory is shared or per node: every rank reads its own view and all
ranks continue from the newest checkpoint any of them found (`load_newest_checkpoint`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.errors import CheckpointError

CHECKPOINT_NAME = "last.pt"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    tmp = directory / f".{CHECKPOINT_NAME}.tmp-{socket.gethostname()}-{os.getpid()}"
    for stale in directory.glob(f".{CHECKPOINT_NAME}.tmp-*"):
        if stale != tmp:  # left by a process killed mid-save; only global rank 0 writes here
            stale.unlink(missing_ok=True)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(directory)
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


def load_newest_checkpoint(
    directory: Path, world_size: int, device: torch.device | None = None
) -> dict[str, Any] | None:
    """Collective: the newest checkpoint any rank can read, the same state on every rank.

    With a per-node directory only the node that held global rank 0 has the file, and after an
    elastic restart rank 0 may sit on another node; the rank holding the newest epoch broadcasts it.
    A rank that cannot read its checkpoint makes every rank raise (none is left waiting).
    """
    if world_size == 1 or not dist.is_initialized():
        return load_checkpoint(directory)
    state: dict[str, Any] | None = None
    error = ""
    try:
        state = load_checkpoint(directory)
    except CheckpointError as exc:
        error = str(exc)
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, (int(state["epoch"]) if state is not None else -1, error))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(views) if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    epochs = [int(epoch) for epoch, _ in views]
    newest = max(epochs)
    if newest < 0:
        return None
    source = epochs.index(newest)
    box = [state if dist.get_rank() == source else None]
    dist.broadcast_object_list(box, src=source, device=device)
    result: dict[str, Any] | None = box[0]
    return result
