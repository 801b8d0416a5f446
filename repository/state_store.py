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

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from repository.desired_state import FORMAT, STATE_FILE, DesiredState, adopted
from repository.errors import NewerRecord, RepositoryError, StateConflict
from repository.model_config import parse, pin_versions, policy_versions

logger = logging.getLogger(__name__)
MAX_WRITE_ATTEMPTS = 16


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
        raise RepositoryError(
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
        raise RepositoryError(
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
