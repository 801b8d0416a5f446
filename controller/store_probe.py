"""The check a controller runs on its store before it acts: every guarantee of the control plane
(no lost state change, one canary checker, one leader) rests on conditional writes, and a store that
ignores `If-None-Match` / `If-Match` (some S3-compatible servers, proxies and caches do) breaks them
all silently. So the controller writes a probe record three ways and refuses to run, naming the
store, when a write that must fail succeeds."""

from __future__ import annotations

import uuid

from controller.errors import ControlError
from repository.errors import StateConflict
from repository.state_store import StateStore


class UnsafeStore(ControlError):
    """The store does not honour conditional writes; the message names the store and the condition."""


def check_conditional_writes(store: StateStore) -> None:
    name = f"probe-{uuid.uuid4().hex[:12]}"
    store.write_record(name, b"created", None)
    try:
        _must_conflict(store, name, b"created again", None, "If-None-Match: * (create only if absent)")
        _, token = store.read_record(name)
        stale = (
            '"00000000000000000000000000000000"' if isinstance(token, str) and token.startswith('"') else "x"
        )
        _must_conflict(store, name, b"stale", stale, "If-Match (replace only what was read)")
        store.write_record(name, b"replaced", token)
    finally:
        try:
            store.remove_record(name)
        except Exception:  # a leftover probe record is harmless: nothing reads it
            pass


def _must_conflict(store: StateStore, name: str, data: bytes, token: object, condition: str) -> None:
    try:
        store.write_record(name, data, token)
    except StateConflict:
        return
    raise UnsafeStore(
        f"the store at {store.url} ignored {condition}: a conditional write that must fail succeeded. "
        "The controller relies on conditional writes (desired state, canary and leader leases); use "
        "a store that honours them (AWS S3, MinIO, Ceph RGW recent releases) or a disk repository"
    )
