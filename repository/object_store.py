"""The desired state, configs and records of a model repository in S3-compatible object storage.

Every write is a conditional PUT (`If-Match` the ETag read, or `If-None-Match: *` for a first write),
so two writers never lose each other's change (repository/s3.py `conditional_put`).
"""

from __future__ import annotations

from typing import Any

from repository.desired_state import STATE_FILE, DesiredState
from repository.layout import CARD, VERSION_CONFIGS, record_file
from repository.s3 import (
    NOT_FOUND,
    ObjectRepository,
    conditional_put,
    error_code,
    get_with_token,
    list_keys,
    published_versions,
    read_card,
    read_object,
)
from repository.state_store import StateStore


class ObjectStateStore(StateStore):
    def __init__(self, url: str, client: Any | None = None) -> None:
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
        return published_versions(self.repo, model, self.client)

    def read(self, model: str) -> tuple[DesiredState | None, object]:
        data, token = get_with_token(self.client, self.repo, self.repo.key(model, STATE_FILE))
        return (None, None) if data is None else (DesiredState.from_json(data), token)

    def write(self, state: DesiredState, token: object) -> None:
        key = self.repo.key(state.model, STATE_FILE)
        conditional_put(self.client, self.repo, key, state.to_json().encode(), token)

    def configs(self, model: str) -> dict[str, str]:
        rels = ["config.pbtxt"] + [
            k[len(self.repo.key(model)) + 1 :]
            for k in list_keys(self.client, self.repo.bucket, self.repo.key(model, "configs") + "/")
            if k.endswith(".pbtxt")
        ]
        out = {}
        for rel in rels:
            data = read_object(self.client, self.repo, model, rel)
            if data is not None:
                out[rel] = data.decode()
        return out

    def write_config(self, model: str, rel: str, text: str, token: object = None) -> None:
        conditional_put(self.client, self.repo, self.repo.key(model, rel), text.encode(), token)

    def model_file_token(self, model: str, rel: str) -> object:
        from botocore.exceptions import ClientError  # boto3 is the s3 extra's: imported where used

        try:
            return self.client.head_object(Bucket=self.repo.bucket, Key=self.repo.key(model, rel))["ETag"]
        except ClientError as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise

    def version_configs(self, model: str, version: int) -> dict[str, str]:
        base = self.repo.key(model, version, VERSION_CONFIGS) + "/"
        out = {}
        for key in list_keys(self.client, self.repo.bucket, base):
            rel = key.removeprefix(base)
            data = read_object(self.client, self.repo, model, version, VERSION_CONFIGS, rel)
            if data is not None:
                out[rel] = data.decode()
        return out

    def model_file(self, model: str, rel: str) -> str | None:
        data = read_object(self.client, self.repo, model, rel)
        return None if data is None else data.decode()

    def card(self, model: str, version: int) -> dict[str, Any]:
        return read_card(self.repo, model, version, self.client)

    def read_record(self, name: str) -> tuple[bytes | None, object]:
        return get_with_token(self.client, self.repo, self.repo.key(record_file(name)))

    def write_record(self, name: str, data: bytes, token: object) -> None:
        conditional_put(self.client, self.repo, self.repo.key(record_file(name)), data, token)

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
        prefix = self.repo.key(model, version) + "/"
        keys = sorted(list_keys(self.client, self.repo.bucket, prefix), key=lambda k: not k.endswith(CARD))
        for key in keys:
            self.client.delete_object(Bucket=self.repo.bucket, Key=key)
