"""S3-compatible object storage as a model repository: URLs, the client, reads and conditional writes.

`s3://bucket/prefix` (the endpoint from the environment, as for any AWS SDK: `AWS_ENDPOINT_URL_S3`
or `AWS_ENDPOINT_URL`; unset means AWS S3) or, as Triton names a non-AWS store,
`s3://host:port/bucket/prefix`. Credentials come from the usual chain (`AWS_ACCESS_KEY_ID`, ...).
Object stores have no rename: publishes keep their guarantees by ordering and conditional writes
(repository/object_publish.py).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from repository.errors import PublishError, StateConflict
from repository.layout import CARD

SCHEME = "s3://"
ENDPOINT = re.compile(r"[0-9A-Za-z.-]+:[0-9]{1,5}")
# What S3 and S3-compatible servers answer when a conditional write's condition does not hold.
CONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
NOT_FOUND = ("NoSuchKey", "404", "NotFound")
# boto3 is the `s3` extra: botocore is imported where it is used, so a disk-only install never needs it.


def is_object_store_url(repo: object) -> bool:
    return isinstance(repo, str) and repo.startswith(SCHEME)


@dataclass(frozen=True)
class ObjectRepository:
    """`s3://bucket/prefix`: a Triton model repository under `prefix` in `bucket`; or, as Triton
    names a non-AWS store, `s3://host:port/bucket/prefix` (HTTP) and `s3://https://host:port/...`."""

    bucket: str
    prefix: str  # without leading or trailing '/', may be empty
    endpoint: str | None = None  # e.g. http://minio:9000; None: the AWS SDK's own (environment)

    @classmethod
    def parse(cls, url: str) -> ObjectRepository:
        if not url.startswith(SCHEME):
            raise PublishError(f"object-store repository {url!r} must start with {SCHEME}")
        rest = url.removeprefix(SCHEME)
        scheme, explicit = "http", False
        for given in ("http://", "https://"):
            if rest.startswith(given):
                scheme, rest, explicit = given.removesuffix("://"), rest.removeprefix(given), True
        endpoint = None
        first, _, after = rest.partition("/")
        if ENDPOINT.fullmatch(first):  # host:port, Triton's form for S3-compatible stores
            endpoint, rest = f"{scheme}://{first}", after
        elif explicit:
            raise PublishError(
                f"{url!r}: after s3://{scheme}:// Triton expects host:port/bucket/prefix (a port is needed)"
            )
        bucket, _, prefix = rest.partition("/")
        if not bucket or ":" in bucket:
            raise PublishError(
                f"{url!r} names no bucket: use s3://BUCKET/PREFIX (AWS, or the endpoint in "
                "AWS_ENDPOINT_URL_S3), or s3://HOST:PORT/BUCKET/PREFIX as Triton reads it"
            )
        return cls(bucket, prefix.strip("/"), endpoint)

    @property
    def url(self) -> str:
        host = ""
        if self.endpoint is not None:
            scheme, _, hostport = self.endpoint.partition("://")
            host = f"{hostport}/" if scheme == "http" else f"{self.endpoint}/"
        return f"{SCHEME}{host}{self.bucket}/{self.prefix}".rstrip("/")

    def client(self) -> Any:
        return s3_client(self.endpoint)

    def key(self, *parts: str | int) -> str:
        return "/".join([self.prefix, *map(str, parts)] if self.prefix else list(map(str, parts)))


def s3_client(endpoint: str | None = None) -> Any:
    """A boto3 S3 client; the endpoint given (from an `s3://host:port/...` URL) or the standard AWS
    environment's, credentials from the standard chain."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise PublishError("publishing to s3:// needs boto3: pip install 'skewserve[s3]'") from exc
    # Path-style addressing works with every S3-compatible server (MinIO, Ceph, moto) and with AWS.
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        # Bounded calls: a store that hangs (botocore waits 60 s by default, times its retries) would
        # stall a reconcile pass and the leader's lease renewals for minutes (found by `make chaos`).
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=5,
            read_timeout=15,
            retries={"total_max_attempts": 3, "mode": "standard"},
        ),
    )


@contextlib.contextmanager
def store_errors(repo: ObjectRepository) -> Iterator[None]:
    """Translate SDK errors (endpoint, credentials, bucket) into a PublishError naming the fix."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as exc:
        raise PublishError(
            f"object store {repo.url}: {exc}; check the bucket exists, AWS_ENDPOINT_URL_S3 "
            "(for non-AWS stores) and the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY credentials"
        ) from exc


def error_code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def conditional_put(client: Any, repo: ObjectRepository, key: str, body: bytes, token: object) -> None:
    """PUT `key` only if it still has the ETag `token` read (None: only if absent); StateConflict if not."""
    from botocore.exceptions import ClientError

    condition = {"IfMatch": str(token)} if token else {"IfNoneMatch": "*"}
    try:
        client.put_object(Bucket=repo.bucket, Key=key, Body=body, **condition)
    except ClientError as exc:
        if error_code(exc) in CONDITION_FAILED:
            raise StateConflict(
                f"{repo.url}/{key.removeprefix(repo.prefix).lstrip('/')} changed since it was read"
            ) from exc
        raise


def get_with_token(client: Any, repo: ObjectRepository, key: str) -> tuple[bytes | None, object]:
    """An object's bytes and its ETag (the token of a conditional write), or (None, None) if absent."""
    from botocore.exceptions import ClientError

    try:
        obj = client.get_object(Bucket=repo.bucket, Key=key)
    except ClientError as exc:
        if error_code(exc) in NOT_FOUND:
            return None, None
        raise
    return bytes(obj["Body"].read()), obj["ETag"]


def list_keys(client: Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def read_object(client: Any, repo: ObjectRepository, *parts: str | int) -> bytes | None:
    from botocore.exceptions import ClientError

    try:
        return bytes(client.get_object(Bucket=repo.bucket, Key=repo.key(*parts))["Body"].read())
    except ClientError as exc:
        if error_code(exc) in NOT_FOUND:
            return None
        raise


def published_versions(repo: ObjectRepository, name: str, client: Any | None = None) -> list[int]:
    """Complete versions of `name`: integer folders that hold their model card (uploaded last)."""
    client = client or repo.client()
    base = repo.key(name) + "/"
    found = set()
    for key in list_keys(client, repo.bucket, base):
        folder, _, leaf = key.removeprefix(base).partition("/")
        if folder.isdigit() and leaf == CARD:
            found.add(int(folder))
    return sorted(found)


def read_card(repo: ObjectRepository, name: str, version: int, client: Any | None = None) -> dict[str, Any]:
    """The model card of a published version; PublishError when the version is not complete."""
    with store_errors(repo):
        data = read_object(client or repo.client(), repo, name, version, CARD)
    if data is None:
        raise PublishError(
            f"{name} version {version} is not published in {repo.url} (no {CARD}); export it first"
        )
    card: dict[str, Any] = json.loads(data)
    return card
