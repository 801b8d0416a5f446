"""Versioned publishes into a Triton model repository on S3-compatible object storage.

`skewserve export --repo s3://bucket/prefix` exports and checks the version in a local staging
folder exactly as for a disk repository, then uploads it here. Object stores have no rename, so the
guarantees of `exporter.publish` are kept by ordering and by conditional writes instead:

1. **Claim** the version number with a conditional PUT (`If-None-Match: *`) of
   `<model>/.publish/claims/<v>`: two publishers never get the same number, and a number once
   claimed (even by a publisher that died) is never reused, so versions stay immutable.
2. **Upload** the version's files under `<model>/<v>/`, the model card last. A version is complete
   when its card exists: that is the rule our own readers (`published_versions`, rollout) apply.
3. **Commit** by adding the version to the model's desired state (`desired_state.json`, a
   conditional PUT; controller/state_store.py) as published, then rewriting the model-level files,
   `config.pbtxt` last, with their version policy naming what the state serves
   (`version_policy { specific { versions: [...] } }`): publishing never changes what is served.

What Triton sees: the NGC image reads `s3://` repositories natively, listing a model's integer
sub-folders, so a half-uploaded `<model>/<v>/` folder *is* listed; Triton loads only the versions
its config's version policy names, and the config names complete versions only. A PUT replaces an
object atomically (readers get the old or the new config, never a mix), so a publisher killed at any
point leaves Triton loading what it loaded before. `.publish` is a non-integer folder: Triton
ignores it, as it ignores `.tmp-*` staging folders on disk.

The endpoint comes from the environment as for any AWS SDK (`AWS_ENDPOINT_URL_S3` or
`AWS_ENDPOINT_URL`; unset means AWS S3), credentials from the usual chain (`AWS_ACCESS_KEY_ID`, ...).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.errors import PublishError
from exporter.publish import CARD, VERSION_CONFIGS, Published
from exporter.triton_config import LOCAL_PROFILE, parse

if TYPE_CHECKING:
    from exporter.pipeline import ExportResult

logger = logging.getLogger(__name__)
SCHEME = "s3://"
ENDPOINT = re.compile(r"[0-9A-Za-z.-]+:[0-9]{1,5}")
CLAIMS = ".publish/claims"
MAX_CLAIM_ATTEMPTS = 64
# Model-level files in commit order: config.pbtxt last, it is what makes a version current.
MODEL_FILE_ORDER = ("labels.txt", f"configs/{LOCAL_PROFILE}.pbtxt", "config.pbtxt")


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
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5}),
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


def _error_code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _keys(client: Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def _read(client: Any, repo: ObjectRepository, *parts: str | int) -> bytes | None:
    from botocore.exceptions import ClientError

    try:
        return bytes(client.get_object(Bucket=repo.bucket, Key=repo.key(*parts))["Body"].read())
    except ClientError as exc:
        if _error_code(exc) in ("NoSuchKey", "404"):
            return None
        raise


def published_versions(repo: ObjectRepository, name: str, client: Any | None = None) -> list[int]:
    """Complete versions of `name`: integer folders that hold their model card (uploaded last)."""
    client = client or repo.client()
    base = repo.key(name) + "/"
    found = set()
    for key in _keys(client, repo.bucket, base):
        folder, _, leaf = key.removeprefix(base).partition("/")
        if folder.isdigit() and leaf == CARD:
            found.add(int(folder))
    return sorted(found)


def read_card(repo: ObjectRepository, name: str, version: int, client: Any | None = None) -> dict[str, Any]:
    """The model card of a published version; PublishError when the version is not complete."""
    with store_errors(repo):
        data = _read(client or repo.client(), repo, name, version, CARD)
    if data is None:
        raise PublishError(
            f"{name} version {version} is not published in {repo.url} (no {CARD}); export it first"
        )
    card: dict[str, Any] = json.loads(data)
    return card


def _claimed(client: Any, repo: ObjectRepository, name: str) -> set[int]:
    base = repo.key(name) + "/"
    taken = set()
    for key in _keys(client, repo.bucket, base):
        rest = key.removeprefix(base)
        head = rest.partition("/")[0]
        if head.isdigit():
            taken.add(int(head))
        elif rest.startswith(CLAIMS + "/") and rest.rsplit("/", 1)[1].isdigit():
            taken.add(int(rest.rsplit("/", 1)[1]))
    return taken


def _claim(client: Any, repo: ObjectRepository, name: str, version: int | None) -> int:
    """Take a version number no other publisher has or ever had, with a conditional create."""
    from botocore.exceptions import ClientError

    taken = _claimed(client, repo, name)
    if version is not None:
        if version < 1:
            raise PublishError(f"version must be a positive integer, got {version}")
        candidates = [version]
    else:
        start = max(taken, default=0) + 1
        candidates = list(range(start, start + MAX_CLAIM_ATTEMPTS))
    for candidate in candidates:
        if candidate in taken:
            break
        try:
            client.put_object(
                Bucket=repo.bucket, Key=repo.key(name, CLAIMS, candidate), Body=b"", IfNoneMatch="*"
            )
            return candidate
        except ClientError as exc:
            if _error_code(exc) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise
    if version is not None:
        raise PublishError(
            f"{name} version {version} already exists in {repo.url}; versions are immutable: "
            "omit --version to take the next one"
        )
    raise PublishError(
        f"could not claim a version of {name} in {repo.url} after {MAX_CLAIM_ATTEMPTS} tries: "
        "too many concurrent publishers"
    )


def _check_compatible(client: Any, repo: ObjectRepository, name: str, new_local_config: str) -> None:
    """Versions of one model share its config: a new version must keep the tensor contract."""
    old_text = _read(client, repo, name, "configs", f"{LOCAL_PROFILE}.pbtxt")
    if old_text is None or not published_versions(repo, name, client):
        return
    old, new = parse(old_text.decode()), parse(new_local_config)

    def shape(cfg: Any) -> list[tuple[str, int, tuple[int, ...]]]:
        return [(t.name, t.data_type, tuple(t.dims)) for t in list(cfg.input) + list(cfg.output)]

    if shape(old) != shape(new):
        raise PublishError(
            f"the new version changes {name}'s tensors ({shape(old)} -> {shape(new)}); versions of one "
            "model share one config: publish it under a new --name"
        )


def _served(client: Any, repo: ObjectRepository, name: str) -> list[int]:
    from controller.state_store import ObjectStateStore

    store = ObjectStateStore(repo.url, client)
    state, _ = store.read(name)
    return (state or store.adopt(name)).served


def publish_version(
    repo: ObjectRepository,
    name: str,
    staging: Path,
    model_files: dict[str, str],
    version: int | None = None,
    client: Any | None = None,
    allow_backend_change: bool = False,
) -> Published:
    """Upload a complete local staging folder as the next (or given) version; see the module doc.

    The model's serving backend is kept in `<model>/serving_backend.json` as on disk
    (exporter/backend.py); it is checked before a version number is claimed.
    """
    from exporter.backend import BACKEND_FILE, backend_file_text, check_backend_change_of, parse_backend_file

    if not (staging / CARD).is_file():
        raise PublishError(
            f"staging folder {staging} has no {CARD}; refusing to publish an incomplete version"
        )
    client = client or repo.client()
    local_key = f"configs/{LOCAL_PROFILE}.pbtxt"
    if local_key in model_files:
        _check_compatible(client, repo, name, model_files[local_key])
    if "config.pbtxt" in model_files:
        old_text = _read(client, repo, name, BACKEND_FILE)
        old = parse_backend_file(old_text.decode(), f"{repo.url}/{name}/{BACKEND_FILE}") if old_text else None
        complete = published_versions(repo, name, client)
        files_of = {v: set(_keys(client, repo.bucket, repo.key(name, v) + "/")) for v in complete}
        backend = check_backend_change_of(
            name,
            old,
            model_files["config.pbtxt"],
            complete,
            allow_backend_change,
            lambda v, filename: repo.key(name, v, filename) in files_of.get(v, set()),
            _served(client, repo, name),
        )
        model_files = {BACKEND_FILE: backend_file_text(backend), **model_files}
    version = _claim(client, repo, name, version)
    # The version keeps the configs it was exported and checked with, beside its files; they become
    # the model's only when it is promoted (controller/state_store.py `materialize`).
    for rel, text in model_files.items():
        if rel != BACKEND_FILE:
            kept = staging / VERSION_CONFIGS / rel
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(text)
    files = sorted((p for p in staging.rglob("*") if p.is_file()), key=lambda p: (p.name == CARD, str(p)))
    for path in files:  # the card last: it marks the version complete
        client.upload_file(
            str(path), repo.bucket, repo.key(name, version, path.relative_to(staging).as_posix())
        )
    # The version joins the desired state as published (controller/desired_state.py); the configs
    # name what the state serves, so publishing never changes what servers load.
    from controller.state_store import ObjectStateStore, pin_versions

    served = ObjectStateStore(repo.url, client).update(name, lambda state: state.published(version)).served
    ordered = sorted(
        model_files, key=lambda rel: MODEL_FILE_ORDER.index(rel) if rel in MODEL_FILE_ORDER else -1
    )
    if version not in served and _read(client, repo, name, "config.pbtxt") is not None:
        ordered = [rel for rel in ordered if rel == BACKEND_FILE]  # the served version's stay
    for rel in ordered:
        text = model_files[rel]
        if rel.endswith(".pbtxt"):
            text = pin_versions(text, served)
        client.put_object(Bucket=repo.bucket, Key=repo.key(name, rel), Body=text.encode())
    logger.info("published %s version %d to %s", name, version, repo.url)
    return Published(name, version, Path(repo.key(name, version)))


def export_to_object_store(
    export: Callable[..., ExportResult],
    artifact: Path,
    url: str,
    name: str,
    version: int | None,
    **kwargs: Any,
) -> ExportResult:
    """Run the disk export into a private staging repository, then publish its version to `url`."""
    repo = ObjectRepository.parse(url)
    client = repo.client()
    with tempfile.TemporaryDirectory(prefix="skewserve-s3-staging-") as tmp:
        result = export(artifact, Path(tmp), name, **kwargs)
        model_dir = Path(tmp) / name
        model_files = {
            rel: (model_dir / rel).read_text() for rel in MODEL_FILE_ORDER if (model_dir / rel).is_file()
        }
        with store_errors(repo):
            published = publish_version(
                repo,
                name,
                result.published.path,
                model_files,
                version,
                client,
                allow_backend_change=bool(kwargs.get("change_backend", False)),
            )
    return replace(result, published=replace(published, path=Path(f"{repo.url}/{name}/{published.version}")))
