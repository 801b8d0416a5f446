"""Versioned, atomic publishes into a Triton model repository on disk.

A version is assembled in `<model>/.tmp-<uuid>` (Triton ignores non-integer version folders), then,
under an exclusive file lock on the model folder, given the next free integer and renamed into place.
Model-level files (configs, labels) are replaced with atomic renames in the same critical section
(repository/disk.py), so a process killed at any moment leaves only dot-named temporaries.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from repository.backend import BACKEND_FILE, backend_file_text, check_backend_change
from repository.desired_state import DesiredState
from repository.disk import (
    atomic_write,
    clean_stale_model_files,
    fsync_dir,
    fsync_tree,
    model_lock,
    published_versions,
)
from repository.disk_store import DiskStateStore
from repository.errors import PublishError
from repository.layout import CARD, VERSION_CONFIGS, Published
from repository.model_config import LOCAL_PROFILE, parse, pin_versions

logger = logging.getLogger(__name__)


def _check_compatible(model_dir: Path, new_local_config: str) -> None:
    """Versions of one model share its config: a new version must keep the tensor contract."""
    existing = model_dir / "configs" / f"{LOCAL_PROFILE}.pbtxt"
    if not existing.is_file() or not published_versions(model_dir):
        return
    old, new = parse(existing.read_text()), parse(new_local_config)

    def shape(cfg: object) -> list[str]:
        # Readable as a user writes tensors: "features FP32 [16]", not protobuf enum numbers.
        return [
            f"{t.name} {mc.DataType.Name(t.data_type).removeprefix('TYPE_')} {list(t.dims)}"
            for t in list(cfg.input) + list(cfg.output)  # type: ignore[attr-defined]
        ]

    before, after = shape(old), shape(new)
    if before != after:
        changed = [f"{a} -> {b}" for a, b in zip(before, after, strict=False) if a != b]
        if len(before) != len(after):
            changed.append(f"{len(before)} tensors -> {len(after)}")
        raise PublishError(
            f"the new version changes {model_dir.name}'s tensors ({'; '.join(changed)}); versions of one "
            "model share one config: publish it under a new --name"
        )


def publish_version(
    model_dir: Path,
    staging: Path,
    model_files: dict[str, str],
    version: int | None = None,
    allow_backend_change: bool = False,
) -> Published:
    """Rename a complete staging folder into `<model_dir>/<version>` and write model-level files.

    `model_files` maps paths relative to the model folder (config.pbtxt, configs/local.pbtxt,
    labels.txt) to their text. The GPU config's backend is kept per model (`repository/backend.py`):
    a publish that changes it is refused unless `allow_backend_change`.
    """
    if not (staging / CARD).is_file():
        raise PublishError(
            f"staging folder {staging} has no {CARD}; refusing to publish an incomplete version"
        )
    local_key = f"configs/{LOCAL_PROFILE}.pbtxt"
    with model_lock(model_dir):
        state = _state(model_dir)
        if local_key in model_files:
            _check_compatible(model_dir, model_files[local_key])
        if "config.pbtxt" in model_files:
            backend = check_backend_change(
                model_dir,
                model_files["config.pbtxt"],
                published_versions(model_dir),
                allow_backend_change,
                state.served,
            )
            model_files = {**model_files, BACKEND_FILE: backend_file_text(backend)}
        taken = published_versions(model_dir) + [int(p.name) for p in model_dir.iterdir() if p.name.isdigit()]
        if version is None:
            version = max(taken, default=0) + 1
        elif version < 1:
            raise PublishError(f"version must be a positive integer, got {version}")
        elif version in taken:
            raise PublishError(
                f"{model_dir.name} version {version} already exists; versions are immutable: omit --version to take {max(taken) + 1}"
            )
        clean_stale_model_files(model_dir, list(model_files))
        # The version keeps the configs it was exported and checked with: they become the model's
        # only when it is promoted (repository/state_store.py `materialize`).
        for rel, text in model_files.items():
            if rel != BACKEND_FILE:
                atomic_write(staging / VERSION_CONFIGS / rel, text)
        served, model_files = _pinned_to_served(state, model_files, version)
        if version not in served and (model_dir / "config.pbtxt").is_file():
            # Not served: the served version's configs stay where servers read them.
            model_files = {rel: text for rel, text in model_files.items() if rel == BACKEND_FILE}
        # Model-level files first: Triton reads them when it loads the new version folder.
        for rel, text in model_files.items():
            atomic_write(model_dir / rel, text)
        fsync_tree(staging)
        target = model_dir / str(version)
        os.rename(staging, target)
        fsync_dir(model_dir)
    # The version joins the model's desired state as published: what servers serve does not change.
    DiskStateStore(model_dir.parent).update(model_dir.name, lambda state: state.published(version))
    logger.info("published %s version %d", model_dir.name, version)
    return Published(model_dir.name, version, target)


def _state(model_dir: Path) -> DesiredState:
    """The model's desired state before this publish (adopted from its configs if it has no record)."""
    store = DiskStateStore(model_dir.parent)
    state, _ = store.read(model_dir.name)
    return state if state is not None else store.adopt(model_dir.name)


def _pinned_to_served(
    state: DesiredState, model_files: dict[str, str], version: int
) -> tuple[list[int], dict[str, str]]:
    """What the model serves once `version` is published (the promoted versions, or `version`
    itself when it is the model's first: repository/desired_state.py), and the configs pinned to it."""
    served = state.published(version).served
    return served, {
        rel: pin_versions(text, served) if rel.endswith(".pbtxt") else text
        for rel, text in model_files.items()
    }
