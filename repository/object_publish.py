"""Versioned publishes into a Triton model repository on S3-compatible object storage.

`skewserve export --repo s3://bucket/prefix` exports and checks the version in a local staging
folder exactly as for a disk repository, then uploads it here. Object stores have no rename, so the
guarantees of `repository/publish.py` are kept by ordering and by conditional writes instead:

1. **Claim** the version number with a conditional PUT (`If-None-Match: *`) of
   `<model>/.publish/claims/<v>`: two publishers never get the same number, and a number once
   claimed (even by a publisher that died) is never reused, so versions stay immutable.
2. **Upload** the version's files under `<model>/<v>/`, the model card last. A version is complete
   when its card exists: that is the rule our own readers (`published_versions`, rollout) apply.
3. **Commit** by adding the version to the model's desired state (`desired_state.json`, a
   conditional PUT; repository/object_store.py) as published, then rewriting the model-level files,
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

import logging
from pathlib import Path
from typing import Any

from repository.backend import BACKEND_FILE, backend_file_text, check_backend_change_of, parse_backend_file
from repository.errors import PublishError
from repository.layout import CARD, MODEL_FILE_ORDER, VERSION_CONFIGS, Published
from repository.model_config import LOCAL_PROFILE, parse, pin_versions
from repository.object_store import ObjectStateStore
from repository.s3 import (
    CONDITION_FAILED,
    ObjectRepository,
    error_code,
    list_keys,
    published_versions,
    read_object,
)

logger = logging.getLogger(__name__)
CLAIMS = ".publish/claims"
MAX_CLAIM_ATTEMPTS = 64


def _claimed(client: Any, repo: ObjectRepository, name: str) -> set[int]:
    base = repo.key(name) + "/"
    taken = set()
    for key in list_keys(client, repo.bucket, base):
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
            if error_code(exc) not in CONDITION_FAILED:
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
    old_text = read_object(client, repo, name, "configs", f"{LOCAL_PROFILE}.pbtxt")
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
    (repository/backend.py); it is checked before a version number is claimed.
    """
    if not (staging / CARD).is_file():
        raise PublishError(
            f"staging folder {staging} has no {CARD}; refusing to publish an incomplete version"
        )
    client = client or repo.client()
    local_key = f"configs/{LOCAL_PROFILE}.pbtxt"
    if local_key in model_files:
        _check_compatible(client, repo, name, model_files[local_key])
    if "config.pbtxt" in model_files:
        old_text = read_object(client, repo, name, BACKEND_FILE)
        old = parse_backend_file(old_text.decode(), f"{repo.url}/{name}/{BACKEND_FILE}") if old_text else None
        complete = published_versions(repo, name, client)
        files_of = {v: set(list_keys(client, repo.bucket, repo.key(name, v) + "/")) for v in complete}
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
    # the model's only when it is promoted (repository/state_store.py `materialize`).
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
    # The version joins the desired state as published (repository/desired_state.py); the configs
    # name what the state serves, so publishing never changes what servers load.
    served = ObjectStateStore(repo.url, client).update(name, lambda state: state.published(version)).served
    ordered = sorted(
        model_files, key=lambda rel: MODEL_FILE_ORDER.index(rel) if rel in MODEL_FILE_ORDER else -1
    )
    if version not in served and read_object(client, repo, name, "config.pbtxt") is not None:
        ordered = [rel for rel in ordered if rel == BACKEND_FILE]  # the served version's stay
    for rel in ordered:
        text = model_files[rel]
        if rel.endswith(".pbtxt"):
            text = pin_versions(text, served)
        client.put_object(Bucket=repo.bucket, Key=repo.key(name, rel), Body=text.encode())
    logger.info("published %s version %d to %s", name, version, repo.url)
    return Published(name, version, Path(repo.key(name, version)))
