"""Where desired state lives: beside the model, in the repository every server and controller reads.

`<model>/desired_state.json` on disk or in object storage. Writes are conditional, so two writers
(a rollout command and a running controller) never lose each other's change: on disk the read and
the write happen under the model's publish lock and the generation must not have moved; on S3 the
PUT carries `If-Match` (the ETag read) or `If-None-Match: *` (first record).

After each change the model's configs are re-pinned to the served versions (`version_policy
{ specific }`), so a server that loads the model without the controller (a plain load, a restart in
`none` mode) loads exactly what was promoted, never the newest published version.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controller.desired_state import FORMAT, STATE_FILE, DesiredState, adopted
from controller.errors import ControlError, NewerRecord, StateConflict
from exporter.triton_config import parse, render

logger = logging.getLogger(__name__)
MAX_WRITE_ATTEMPTS = 16


def record_file(name: str) -> str:
    return f".skewserve-{name}.json"


def pin_versions(config_text: str, versions: list[int]) -> str:
    """The config with its version policy naming exactly `versions`."""
    cfg = parse(config_text)
    cfg.version_policy.specific.versions[:] = sorted(versions)
    return render(cfg)


def policy_versions(config_text: str, complete: list[int]) -> list[int]:
    """What a config's version policy serves among `complete` versions (Triton's own reading)."""
    cfg = parse(config_text)
    policy = cfg.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        return list(complete)
    if policy == "specific":
        return [v for v in cfg.version_policy.specific.versions if v in complete]
    keep = cfg.version_policy.latest.num_versions if policy == "latest" else 1
    return complete[-max(keep, 1) :]


class StateStore(ABC):
    """One repository's desired states, configs and versions (disk or object storage)."""

    url: str

    @abstractmethod
    def models(self) -> list[str]: ...

    @abstractmethod
    def published_versions(self, model: str) -> list[int]: ...

    @abstractmethod
    def read(self, model: str) -> tuple[DesiredState | None, object]:
        """The record and a token for a conditional write (None when the model has no record)."""

    @abstractmethod
    def write(self, state: DesiredState, token: object) -> None:
        """Write if nobody wrote since `token` was read; StateConflict otherwise."""

    @abstractmethod
    def configs(self, model: str) -> dict[str, str]:
        """Model-level config files (config.pbtxt, configs/*.pbtxt) by path relative to the model."""

    @abstractmethod
    def write_config(self, model: str, rel: str, text: str, token: object = None) -> None:
        """Write a model-level file if it did not change since `token` was read (None: only if
        absent); StateConflict otherwise."""

    @abstractmethod
    def model_file_token(self, model: str, rel: str) -> object:
        """A token for a conditional write of the model-level file (None when it is absent)."""

    @abstractmethod
    def version_configs(self, model: str, version: int) -> dict[str, str]:
        """The model-level files (configs, labels) `version` was published with; empty for a
        version published before they were kept (its configs are the model's own)."""

    @abstractmethod
    def model_file(self, model: str, rel: str) -> str | None: ...

    @abstractmethod
    def card(self, model: str, version: int) -> dict[str, Any]: ...

    @abstractmethod
    def remove_version(self, model: str, version: int) -> None: ...

    @abstractmethod
    def version_bytes(self, model: str, version: int) -> int:
        """Bytes of the version's files (placement's footprint when Triton reports none)."""

    @abstractmethod
    def read_record(self, name: str) -> tuple[bytes | None, object]:
        """A repository-level record (`.skewserve-<name>.json` at the root, beside no model, which
        Triton never reads as one) and a token for a conditional write."""

    @abstractmethod
    def write_record(self, name: str, data: bytes, token: object) -> None:
        """Write if nobody wrote since `token` was read (None: only if absent); StateConflict otherwise."""

    @abstractmethod
    def remove_record(self, name: str) -> None: ...

    # -- shared logic --------------------------------------------------------------------------
    def current(self, model: str) -> DesiredState | None:
        """The record, adopting a model published before desired state existed (written once)."""
        state, _ = self.read(model)
        if state is None and self.configs(model).get("config.pbtxt") and self.published_versions(model):
            state = self.update(model, lambda s: s)
        return state

    def update(self, model: str, change: Callable[[DesiredState], DesiredState]) -> DesiredState:
        """Apply `change` to the current record with a conditional write, retrying on conflicts."""
        for _ in range(MAX_WRITE_ATTEMPTS):
            state, token = self.read(model)
            if state is None:
                state = self.adopt(model)
                fresh = True
            else:
                fresh = False
            if state.newer:
                raise NewerRecord(
                    f"{self.url}/{model}/{STATE_FILE} has format {state.format}, written by a newer "
                    f"skewserve controller; this one reads format {FORMAT} and does not overwrite it: "
                    "upgrade it (or the command) before changing this model"
                )
            new = change(state)
            if new is state and not fresh:
                self.materialize(new)
                return new
            try:
                self.write(new, token)
            except StateConflict:
                continue
            logger.info("%s desired state generation %d: served %s", model, new.generation, new.served)
            self.materialize(new)
            return new
        raise ControlError(
            f"{self.url}/{model}: desired state kept changing under {MAX_WRITE_ATTEMPTS} writes"
        )

    def adopt(self, model: str) -> DesiredState:
        config = self.configs(model).get("config.pbtxt")
        if config is None:
            return DesiredState(model=model)  # nothing committed yet: the first publish starts it
        complete = self.published_versions(model)
        return adopted(model, complete, policy_versions(config, complete))

    def materialize(self, state: DesiredState) -> None:
        """The model-level files of the newest served version (the configs it was published and
        checked with), every config pinned to the served versions (idempotent).

        Written conditionally, and from the record as read *after* the files' tokens: a writer
        acting on an older record either finishes before a newer one reads the files, or its write
        conflicts and it starts again from the newest record, so no stale pin outlives a race."""
        for _ in range(MAX_WRITE_ATTEMPTS):
            rels = [*self.configs(state.model), *self.version_configs(state.model, max(state.served or [0]))]
            tokens = {rel: self.model_file_token(state.model, rel) for rel in dict.fromkeys(rels)}
            latest, _ = self.read(state.model)
            if latest is not None:
                state = latest
            if not state.served or state.newer:
                return
            try:
                self._write_served_files(state, tokens)
                return
            except StateConflict:
                continue
        raise ControlError(
            f"{self.url}/{state.model}: configs kept changing under {MAX_WRITE_ATTEMPTS} writes"
        )

    def _write_served_files(self, state: DesiredState, tokens: dict[str, object]) -> None:
        current = self.configs(state.model)
        # the version's own files; profiles it does not have (added by hand) stay, re-pinned
        files = {**current, **self.version_configs(state.model, max(state.served))}
        for rel, text in files.items():
            token = tokens.get(rel, self.model_file_token(state.model, rel))
            if not rel.endswith(".pbtxt"):
                if self.model_file(state.model, rel) != text:
                    self.write_config(state.model, rel, text, token)
                continue
            pinned = pin_versions(text, state.served)
            if rel not in current or parse(pinned) != parse(current[rel]):
                self.write_config(state.model, rel, pinned, token)


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
        from exporter.publish import CARD, published_versions

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
        from exporter.publish import _atomic_write, model_lock

        model_dir = self.root / state.model
        with model_lock(model_dir):
            current, now = self.read(state.model)
            if now != token:
                raise StateConflict(f"{model_dir}/{STATE_FILE} changed (generation {now}, read {token})")
            _atomic_write(model_dir / STATE_FILE, state.to_json())

    def configs(self, model: str) -> dict[str, str]:
        model_dir = self.root / model
        paths = [model_dir / "config.pbtxt", *sorted((model_dir / "configs").glob("*.pbtxt"))]
        return {p.relative_to(model_dir).as_posix(): p.read_text() for p in paths if p.is_file()}

    def write_config(self, model: str, rel: str, text: str, token: object = None) -> None:
        from exporter.publish import _atomic_write, model_lock

        model_dir = self.root / model
        with model_lock(model_dir):  # the lock publishes take: a compare and a rename
            now = self.model_file_token(model, rel)
            if now != token:
                raise StateConflict(f"{model_dir / rel} changed since it was read")
            _atomic_write(model_dir / rel, text)

    def model_file_token(self, model: str, rel: str) -> object:
        path = self.root / model / rel
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None

    def version_configs(self, model: str, version: int) -> dict[str, str]:
        from exporter.publish import VERSION_CONFIGS

        folder = self.root / model / str(version) / VERSION_CONFIGS
        if not folder.is_dir():
            return {}
        return {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()}

    def model_file(self, model: str, rel: str) -> str | None:
        path = self.root / model / rel
        return path.read_text() if path.is_file() else None

    def card(self, model: str, version: int) -> dict[str, Any]:
        from exporter.publish import CARD

        path = self.root / model / str(version) / CARD
        if not path.is_file():
            raise ControlError(
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
        from exporter.publish import _atomic_write

        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{record_file(name)}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held for a read and a rename: never long
            try:
                _, now = self.read_record(name)
                if now != token:
                    raise StateConflict(f"{self.root / record_file(name)} changed since it was read")
                _atomic_write(self.root / record_file(name), data.decode())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def remove_record(self, name: str) -> None:
        (self.root / record_file(name)).unlink(missing_ok=True)
        (self.root / f"{record_file(name)}.lock").unlink(missing_ok=True)

    def remove_version(self, model: str, version: int) -> None:
        """Rename aside first (readers then never see half a folder), then delete."""
        from exporter.publish import STAGING_PREFIX, model_lock

        model_dir = self.root / model
        with model_lock(model_dir):
            src = model_dir / str(version)
            if not src.is_dir():
                return
            # A staging-style name: if we die before the delete, the next publish clears it.
            doomed = model_dir / f"{STAGING_PREFIX}removed{version}-{os.getpid()}"
            src.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


class ObjectStateStore(StateStore):
    def __init__(self, url: str, client: Any | None = None) -> None:
        from exporter.object_store import ObjectRepository

        self.repo = ObjectRepository.parse(url)
        self.url = self.repo.url
        self.client = client or self.repo.client()

    def models(self) -> list[str]:
        prefix = self.repo.key("") if self.repo.prefix else ""
        names = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.repo.bucket, Prefix=prefix, Delimiter="/"
        ):
            for common in page.get("CommonPrefixes", []):
                names.add(common["Prefix"][len(prefix) :].strip("/"))
        return sorted(n for n in names if n and not n.startswith("."))

    def published_versions(self, model: str) -> list[int]:
        from exporter.object_store import published_versions

        return published_versions(self.repo, model, self.client)

    def read(self, model: str) -> tuple[DesiredState | None, object]:
        from botocore.exceptions import ClientError

        from exporter.object_store import _error_code

        try:
            obj = self.client.get_object(Bucket=self.repo.bucket, Key=self.repo.key(model, STATE_FILE))
        except ClientError as exc:
            if _error_code(exc) in ("NoSuchKey", "404"):
                return None, None
            raise
        return DesiredState.from_json(obj["Body"].read()), obj["ETag"]

    def write(self, state: DesiredState, token: object) -> None:
        from botocore.exceptions import ClientError

        from exporter.object_store import _error_code

        condition = {"IfMatch": str(token)} if token else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(
                Bucket=self.repo.bucket,
                Key=self.repo.key(state.model, STATE_FILE),
                Body=state.to_json().encode(),
                **condition,
            )
        except ClientError as exc:
            if _error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise StateConflict(
                    f"{self.url}/{state.model}/{STATE_FILE} changed since it was read"
                ) from exc
            raise

    def configs(self, model: str) -> dict[str, str]:
        from exporter.object_store import _keys, _read

        rels = ["config.pbtxt"] + [
            k[len(self.repo.key(model)) + 1 :]
            for k in _keys(self.client, self.repo.bucket, self.repo.key(model, "configs") + "/")
            if k.endswith(".pbtxt")
        ]
        out = {}
        for rel in rels:
            data = _read(self.client, self.repo, model, rel)
            if data is not None:
                out[rel] = data.decode()
        return out

    def write_config(self, model: str, rel: str, text: str, token: object = None) -> None:
        from botocore.exceptions import ClientError

        from exporter.object_store import _error_code

        condition = {"IfMatch": str(token)} if token else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(
                Bucket=self.repo.bucket, Key=self.repo.key(model, rel), Body=text.encode(), **condition
            )
        except ClientError as exc:
            if _error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise StateConflict(f"{self.url}/{model}/{rel} changed since it was read") from exc
            raise

    def model_file_token(self, model: str, rel: str) -> object:
        from botocore.exceptions import ClientError

        from exporter.object_store import _error_code

        try:
            return self.client.head_object(Bucket=self.repo.bucket, Key=self.repo.key(model, rel))["ETag"]
        except ClientError as exc:
            if _error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def version_configs(self, model: str, version: int) -> dict[str, str]:
        from exporter.object_store import _keys, _read
        from exporter.publish import VERSION_CONFIGS

        base = self.repo.key(model, version, VERSION_CONFIGS) + "/"
        out = {}
        for key in _keys(self.client, self.repo.bucket, base):
            rel = key.removeprefix(base)
            data = _read(self.client, self.repo, model, version, VERSION_CONFIGS, rel)
            if data is not None:
                out[rel] = data.decode()
        return out

    def model_file(self, model: str, rel: str) -> str | None:
        from exporter.object_store import _read

        data = _read(self.client, self.repo, model, rel)
        return None if data is None else data.decode()

    def card(self, model: str, version: int) -> dict[str, Any]:
        from exporter.errors import PublishError
        from exporter.object_store import read_card

        try:
            return read_card(self.repo, model, version, self.client)
        except PublishError as exc:
            raise ControlError(str(exc)) from exc

    def read_record(self, name: str) -> tuple[bytes | None, object]:
        from botocore.exceptions import ClientError

        from exporter.object_store import _error_code

        try:
            obj = self.client.get_object(Bucket=self.repo.bucket, Key=self.repo.key(record_file(name)))
        except ClientError as exc:
            if _error_code(exc) in ("NoSuchKey", "404"):
                return None, None
            raise
        return obj["Body"].read(), obj["ETag"]

    def write_record(self, name: str, data: bytes, token: object) -> None:
        from botocore.exceptions import ClientError

        from exporter.object_store import _error_code

        condition = {"IfMatch": str(token)} if token else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(
                Bucket=self.repo.bucket, Key=self.repo.key(record_file(name)), Body=data, **condition
            )
        except ClientError as exc:
            if _error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise StateConflict(f"{self.url}/{record_file(name)} changed since it was read") from exc
            raise

    def remove_record(self, name: str) -> None:
        self.client.delete_object(Bucket=self.repo.bucket, Key=self.repo.key(record_file(name)))

    def version_bytes(self, model: str, version: int) -> int:
        total = 0
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.repo.bucket, Prefix=self.repo.key(model, version) + "/"
        ):
            total += sum(int(o["Size"]) for o in page.get("Contents", []))
        return total

    def remove_version(self, model: str, version: int) -> None:
        """The card first: the version stops being complete before any of its files go."""
        from exporter.object_store import _keys

        prefix = self.repo.key(model, version) + "/"
        keys = sorted(
            _keys(self.client, self.repo.bucket, prefix), key=lambda k: not k.endswith("model_card.json")
        )
        for key in keys:
            self.client.delete_object(Bucket=self.repo.bucket, Key=key)


def open_store(repo: str | Path) -> StateStore:
    from exporter.object_store import is_object_store_url

    if is_object_store_url(repo):
        return ObjectStateStore(str(repo))
    return DiskStateStore(Path(repo))
