"""Disk primitives of a model repository: locks, staging folders, fsynced atomic writes.

Everything is fsynced before its rename, so a rename publishes complete bytes even across a power
loss; a process killed at any moment leaves only dot-named temporaries, which readers (Triton,
`published_versions`) ignore and the next publish removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from repository.errors import PublishError
from repository.layout import CARD, MODEL_FILE_TMP, STAGING_PREFIX


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush a staged version's files and folders, so its rename never publishes unwritten bytes."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


def model_file_tmp_glob(target: Path) -> str:
    return f".{target.name}{MODEL_FILE_TMP}*"


def atomic_write(path: Path, text: str) -> None:
    """Write aside, fsync, rename: a reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{MODEL_FILE_TMP}{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def clean_stale_model_files(model_dir: Path, rels: list[str]) -> None:
    """Temporaries of model-level files left by a killed publish (callers hold the model lock)."""
    for rel in rels:
        target = model_dir / rel
        if target.parent.is_dir():
            for stale in target.parent.glob(model_file_tmp_glob(target)):
                stale.unlink(missing_ok=True)
