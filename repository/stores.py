"""Open a repository's store from what the user gave: a folder or an `s3://` URL."""

from __future__ import annotations

from pathlib import Path

from repository.disk_store import DiskStateStore
from repository.object_store import ObjectStateStore
from repository.s3 import is_object_store_url
from repository.state_store import StateStore


def open_store(repo: str | Path) -> StateStore:
    if is_object_store_url(repo):
        return ObjectStateStore(str(repo))
    return DiskStateStore(Path(repo))
