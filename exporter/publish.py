"""Versioned, atomic publishes into a Triton model repository.

A version is assembled in `<model>/.tmp-<uuid>` (Triton ignores non-integer version folders), then,
under an exclusive file lock on the model folder, given the next free integer and renamed into place.
Model-level files (configs, labels) are replaced with atomic renames in the same critical section.
Everything is fsynced before its rename, so the rename publishes complete bytes even across a power
loss; a process killed at any moment leaves only dot-named temporaries, which readers (Triton,
`published_versions`) ignore and the next publish removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from exporter.errors import PublishError
from exporter.triton_config import LOCAL_PROFILE, parse

logger = logging.getLogger(__name__)
STAGING_PREFIX = ".tmp-"
# Model-level files are written as `.<name>.tmp-<hex>` beside their target, then renamed.
MODEL_FILE_TMP = ".tmp-"
CARD = "model_card.json"


@dataclass(frozen=True)
class Published:
    name: str
    version: int
    path: Path


# Inside each version folder: the model-level files (configs, labels) it was published with. Triton
# reads only the model files a backend names there, so the folder is invisible to it.
VERSION_CONFIGS = ".skewserve-configs"


def published_versions(model_dir: Path) -> list[int]:
    """Integer version folders that are complete (hold their model card)."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.name.isdigit() and (p / CARD).is_file())


@contextlib.contextmanager
def model_lock(model_dir: Path, timeout_s: float = 120.0) -> Iterator[None]:
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / ".publish.lock", "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PublishError(
                        f"another export holds {model_dir}/.publish.lock for over {timeout_s:.0f}s"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def new_staging_dir(model_dir: Path) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(model_dir)
    path = model_dir / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}-{os.getpid()}"
    path.mkdir()
    return path


def clean_stale_staging(model_dir: Path) -> None:
    """Remove staging folders left by killed exports (their pid no longer runs)."""
    for p in model_dir.glob(f"{STAGING_PREFIX}*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush a staged version's files and folders, so its rename never publishes unwritten bytes."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(root)


def _model_file_tmp_glob(target: Path) -> str:
    return f".{target.name}{MODEL_FILE_TMP}*"


def _atomic_write(path: Path, text: str) -> None:
    """Write aside, fsync, rename: a reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{MODEL_FILE_TMP}{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _clean_stale_model_files(model_dir: Path, rels: list[str]) -> None:
    """Temporaries of model-level files left by a killed publish (callers hold the model lock)."""
    for rel in rels:
        target = model_dir / rel
        if target.parent.is_dir():
            for stale in target.parent.glob(_model_file_tmp_glob(target)):
                stale.unlink(missing_ok=True)


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
    labels.txt) to their text. The GPU config's backend is kept per model (`exporter/backend.py`):
    a publish that changes it is refused unless `allow_backend_change`.
    """
    from exporter.backend import BACKEND_FILE, backend_file_text, check_backend_change

    if not (staging / CARD).is_file():
        raise PublishError(
            f"staging folder {staging} has no {CARD}; refusing to publish an incomplete version"
        )
    local_key = f"configs/{LOCAL_PROFILE}.pbtxt"
    with model_lock(model_dir):
        if local_key in model_files:
            _check_compatible(model_dir, model_files[local_key])
        if "config.pbtxt" in model_files:
            backend = check_backend_change(
                model_dir, model_files["config.pbtxt"], published_versions(model_dir), allow_backend_change
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
        _clean_stale_model_files(model_dir, list(model_files))
        # The version keeps the configs it was exported and checked with: they become the model's
        # only when it is promoted (controller/state_store.py `materialize`).
        for rel, text in model_files.items():
            if rel != BACKEND_FILE:
                _atomic_write(staging / VERSION_CONFIGS / rel, text)
        served, model_files = _pinned_to_served(model_dir, model_files, version)
        if version not in served and (model_dir / "config.pbtxt").is_file():
            # Not served: the served version's configs stay where servers read them.
            model_files = {rel: text for rel, text in model_files.items() if rel == BACKEND_FILE}
        # Model-level files first: Triton reads them when it loads the new version folder.
        for rel, text in model_files.items():
            _atomic_write(model_dir / rel, text)
        _fsync_tree(staging)
        target = model_dir / str(version)
        os.rename(staging, target)
        _fsync_dir(model_dir)
    from controller.state_store import DiskStateStore

    # The version joins the model's desired state as published: what servers serve does not change.
    DiskStateStore(model_dir.parent).update(model_dir.name, lambda state: state.published(version))
    logger.info("published %s version %d", model_dir.name, version)
    return Published(model_dir.name, version, target)


def _pinned_to_served(
    model_dir: Path, model_files: dict[str, str], version: int
) -> tuple[list[int], dict[str, str]]:
    """What the model serves once `version` is published (the promoted versions, or `version`
    itself when it is the model's first: controller/desired_state.py), and the configs pinned to it."""
    from controller.state_store import DiskStateStore, pin_versions

    store = DiskStateStore(model_dir.parent)
    state, _ = store.read(model_dir.name)
    if state is None:
        state = store.adopt(model_dir.name)
    served = state.published(version).served
    return served, {
        rel: pin_versions(text, served) if rel.endswith(".pbtxt") else text
        for rel, text in model_files.items()
    }
