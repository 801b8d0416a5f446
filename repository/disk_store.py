"""The desired state, configs and records of a model repository on disk (a local folder or a volume).

Conditional writes hold the model's publish lock for a compare and a rename (repository/disk.py), so
a publish and a controller never lose each other's change.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from repository.desired_state import STATE_FILE, DesiredState
from repository.disk import atomic_write, model_lock, published_versions
from repository.errors import PublishError, StateConflict
from repository.layout import CARD, STAGING_PREFIX, VERSION_CONFIGS, record_file
from repository.state_store import StateStore


class DiskStateStore(StateStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def models(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and (p / "config.pbtxt").is_file())

    def published_versions(self, model: str) -> list[int]:
        """Complete versions (holding their model card); for a model written by hand, without a card
        in any version, its integer folders, as Triton reads them."""

        model_dir = self.root / model
        found = published_versions(model_dir)
        if found or not model_dir.is_dir():
            return found
        folders = [p for p in model_dir.iterdir() if p.name.isdigit() and p.is_dir()]
        if any((p / CARD).exists() for p in folders):
            return []
        return sorted(int(p.name) for p in folders)

    def read(self, model: str) -> tuple[DesiredState | None, object]:
        path = self.root / model / STATE_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None, 0
        state = DesiredState.from_json(text)
        return state, state.generation

    def write(self, state: DesiredState, token: object) -> None:

        model_dir = self.root / state.model
        with model_lock(model_dir):
            current, now = self.read(state.model)
            if now != token:
                raise StateConflict(f"{model_dir}/{STATE_FILE} changed (generation {now}, read {token})")
            atomic_write(model_dir / STATE_FILE, state.to_json())

    def configs(self, model: str) -> dict[str, str]:
        model_dir = self.root / model
        paths = [model_dir / "config.pbtxt", *sorted((model_dir / "configs").glob("*.pbtxt"))]
        return {p.relative_to(model_dir).as_posix(): p.read_text() for p in paths if p.is_file()}

    def write_config(self, model: str, rel: str, text: str, token: object = None) -> None:

        model_dir = self.root / model
        with model_lock(model_dir):  # the lock publishes take: a compare and a rename
            now = self.model_file_token(model, rel)
            if now != token:
                raise StateConflict(f"{model_dir / rel} changed since it was read")
            atomic_write(model_dir / rel, text)

    def model_file_token(self, model: str, rel: str) -> object:
        path = self.root / model / rel
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None

    def version_configs(self, model: str, version: int) -> dict[str, str]:

        folder = self.root / model / str(version) / VERSION_CONFIGS
        if not folder.is_dir():
            return {}
        return {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()}

    def model_file(self, model: str, rel: str) -> str | None:
        path = self.root / model / rel
        return path.read_text() if path.is_file() else None

    def card(self, model: str, version: int) -> dict[str, Any]:

        path = self.root / model / str(version) / CARD
        if not path.is_file():
            raise PublishError(
                f"{model} version {version} is not published in {self.root} (no {CARD}); export it first"
            )
        card: dict[str, Any] = json.loads(path.read_text())
        return card

    def version_bytes(self, model: str, version: int) -> int:
        folder = self.root / model / str(version)
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    def read_record(self, name: str) -> tuple[bytes | None, object]:
        try:
            data = (self.root / record_file(name)).read_bytes()
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    def write_record(self, name: str, data: bytes, token: object) -> None:

        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{record_file(name)}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held for a read and a rename: never long
            try:
                _, now = self.read_record(name)
                if now != token:
                    raise StateConflict(f"{self.root / record_file(name)} changed since it was read")
                atomic_write(self.root / record_file(name), data.decode())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def remove_record(self, name: str) -> None:
        (self.root / record_file(name)).unlink(missing_ok=True)
        (self.root / f"{record_file(name)}.lock").unlink(missing_ok=True)

    def remove_version(self, model: str, version: int) -> None:
        """Rename aside first (readers then never see half a folder), then delete."""

        model_dir = self.root / model
        with model_lock(model_dir):
            src = model_dir / str(version)
            if not src.is_dir():
                return
            # A staging-style name: if we die before the delete, the next publish clears it.
            doomed = model_dir / f"{STAGING_PREFIX}removed{version}-{os.getpid()}"
            src.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
