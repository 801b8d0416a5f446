"""Publishing to an S3-compatible store (moto's server, a real process) keeps the disk guarantees."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tritonclient.http as httpclient

from controller.errors import RolloutError
from controller.rollout import rollout, static_servers
from exporter.pipeline import export_artifact
from repository.errors import PublishError
from repository.layout import VERSION_CONFIGS
from repository.model_config import parse
from repository.object_publish import CLAIMS
from repository.object_store import ObjectStateStore
from repository.s3 import ObjectRepository, published_versions, s3_client
from tests.deploy.conftest import HoldingProxy, S3Server
from tests.waiting import wait_until

NAME = "lt"
VERSION_FILES = {
    "batching.py",
    "model.onnx",
    "model.py",
    "model_card.json",
    *(f"{VERSION_CONFIGS}/{rel}" for rel in ("config.pbtxt", "configs/local.pbtxt", "labels.txt")),
}


def _bucket(client: Any, name: str) -> ObjectRepository:
    client.create_bucket(Bucket=name)
    return ObjectRepository.parse(f"s3://{name}/models/prod")


def _objects(client: Any, repo: ObjectRepository, *parts: str | int) -> dict[str, str]:
    """key -> sha256 of every object under a prefix."""
    prefix = repo.key(*parts) + "/"
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=repo.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=repo.bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"].removeprefix(prefix)] = hashlib.sha256(body).hexdigest()
    return out


def _pinned(client: Any, repo: ObjectRepository, config: str = "config.pbtxt") -> list[int]:
    text = client.get_object(Bucket=repo.bucket, Key=repo.key(NAME, config))["Body"].read().decode()
    return list(parse(text).version_policy.specific.versions)


def test_publish_twice_gives_next_version_with_configs_naming_complete_versions(
    small_artifact: Path, s3_env: dict[str, str]
) -> None:
    client = s3_client()
    repo = _bucket(client, "twice")
    first = export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
    second = subprocess.run(  # the command line, as a user runs it
        [sys.executable, "-m", "skewserve", "export", "--artifact", str(small_artifact)]
        + ["--repo", repo.url, "--name", NAME, "--tensorrt", "off"],
        env={**os.environ, **s3_env},
        capture_output=True,
        text=True,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert first.published.version == 1
    assert "published lt version 2 at s3://twice/models/prod/lt/2\n" in second.stdout
    assert published_versions(repo, NAME) == [1, 2]
    # the first version is served; the second is published, and serving it is a rollout away
    assert _pinned(client, repo) == [1] and _pinned(client, repo, "configs/local.pbtxt") == [1]
    state = ObjectStateStore(repo.url, client).current(NAME)
    assert state is not None and state.served == [1] and state.versions[2].state == "published"
    v1 = _objects(client, repo, NAME, 1)
    assert set(v1) == VERSION_FILES
    card = json.loads(
        client.get_object(Bucket=repo.bucket, Key=repo.key(NAME, 1, "model_card.json"))["Body"].read()
    )
    model_files = {
        k: v for k, v in v1.items() if k != "model_card.json" and not k.startswith(VERSION_CONFIGS)
    }
    assert model_files == card["export"]["files"]
    # each version keeps the configs it was published with; the second's are not the served ones
    kept = client.get_object(Bucket=repo.bucket, Key=repo.key(NAME, 2, VERSION_CONFIGS, "config.pbtxt"))
    assert parse(kept["Body"].read().decode()).name == NAME
    assert card["export"]["serving_target"]["image"].startswith("nvcr.io/nvidia/tritonserver:")

    with pytest.raises(
        PublishError, match=r"^lt version 2 already exists in s3://twice/models/prod; versions are immutable"
    ):
        export_artifact(small_artifact, repo.url, NAME, version=2, tensorrt="off")
    assert _objects(client, repo, NAME, 1) == v1  # earlier versions untouched


def test_bad_bucket_is_a_publish_error_naming_the_fix(small_artifact: Path, s3_env: dict[str, str]) -> None:
    with pytest.raises(PublishError, match=r"^object store s3://no-such-bucket/m: .*check the bucket exists"):
        export_artifact(small_artifact, "s3://no-such-bucket/m", NAME, tensorrt="off")


@pytest.mark.parametrize(
    ("held", "complete_after_kill"),
    [
        # killed with the version's files half uploaded: the card (uploaded last) is missing
        (rb"PUT /[\w-]+/models/prod/lt/2/model_card\.json ", [1]),
        # killed after the card, before the version joined the desired state: complete, not served
        (rb"PUT /[\w-]+/models/prod/lt/desired_state\.json ", [1, 2]),
        # killed after the desired state, at the model's backend record: complete, not served (a
        # version not served writes no config where servers read them)
        (rb"PUT /[\w-]+/models/prod/lt/serving_backend\.json ", [1, 2]),
    ],
    ids=["mid-version", "before-state", "after-state"],
)
def test_sigkilled_export_leaves_no_partial_version_visible(
    small_artifact: Path,
    s3_server: S3Server,
    s3_env: dict[str, str],
    held: bytes,
    complete_after_kill: list[int],
) -> None:
    client = s3_client()
    bucket = "killed-" + ("a" if b"card" in held else "b" if b"desired" in held else "c")
    repo = _bucket(client, bucket)
    export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
    v1 = _objects(client, repo, NAME, 1)

    proxy = HoldingProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), held)
    env = {**os.environ, **s3_env, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{proxy.port}"}
    cmd = [sys.executable, "-m", "skewserve", "export", "--artifact", str(small_artifact)]
    proc = subprocess.Popen(
        [*cmd, "--repo", repo.url, "--name", NAME, "--tensorrt", "off"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # The export trains nothing but runs parity checks before it publishes.
        wait_until(
            lambda: proxy.held.is_set() or proc.poll() is not None,
            240,
            "the publisher to reach the held request",
        )
        assert proc.poll() is None, proc.communicate()[0].decode()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proxy.close()

    assert "model.onnx" in _objects(client, repo, NAME, 2)  # it really died mid-publish
    assert published_versions(repo, NAME) == complete_after_kill
    assert _pinned(client, repo) == [1]  # Triton still loads exactly what it loaded before
    assert _objects(client, repo, NAME, 1) == v1
    # The model-level files a kill can leave rewritten name complete versions only, and labels.txt
    # (rewritten first) is one that version 1 serves with: the same classes.
    assert set(_pinned(client, repo, "configs/local.pbtxt")) <= set(complete_after_kill)
    labels = client.get_object(Bucket=repo.bucket, Key=repo.key(NAME, "labels.txt"))["Body"].read().decode()
    card = json.loads(
        client.get_object(Bucket=repo.bucket, Key=repo.key(NAME, 1, "model_card.json"))["Body"].read()
    )
    assert labels.split() == [str(c) for c in card["artifact"]["metadata"]["classes"]]

    # the next publish takes a fresh number (2 stays claimed) and becomes current
    third = export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
    assert third.published.version == 3
    assert published_versions(repo, NAME) == [*complete_after_kill, 3]
    assert _pinned(client, repo) == [1]  # publishing never changes what is served
    assert _objects(client, repo, NAME, 1) == v1


def test_rollout_reads_the_card_from_the_object_store(s3_env: dict[str, str]) -> None:
    client = s3_client()
    repo = _bucket(client, "rollout-missing")
    with pytest.raises(RolloutError, match=r"^lt is not published in s3://rollout-missing/models/prod"):
        rollout(ObjectStateStore(repo.url, client), NAME, 7, static_servers(["http://127.0.0.1:1"]))


def _mirror(client: Any, repo: ObjectRepository, dest: Path) -> None:
    """Every object under the repository prefix, as files: the tree Triton's S3 filesystem lists.

    (The tritonserver in nvidia-pytriton has no S3 support; the NGC image reads the bucket itself.)
    """
    base = repo.key() + "/" if repo.prefix else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=repo.bucket, Prefix=base):
        for obj in page.get("Contents", []):
            path = dest / obj["Key"].removeprefix(base)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(client.get_object(Bucket=repo.bucket, Key=obj["Key"])["Body"].read())


@pytest.mark.slow
def test_triton_loads_only_complete_versions_and_rollout_reads_the_store(
    small_artifact: Path, s3_env: dict[str, str], tmp_path: Path, prepared_triton: Any
) -> None:
    from skewserve.triton_process import TritonServer, TritonServerSpec

    client = s3_client()
    repo = _bucket(client, "triton-view")
    export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
    # a half-uploaded version 2, as a publisher killed mid-version leaves it (see the SIGKILL test)
    client.put_object(Bucket=repo.bucket, Key=repo.key(NAME, 2, "model.onnx"), Body=b"half an upload")
    client.put_object(Bucket=repo.bucket, Key=repo.key(NAME, CLAIMS, 2), Body=b"")
    mirror = tmp_path / "mirror"
    _mirror(client, repo, mirror)
    assert (mirror / NAME / "2" / "model.onnx").is_file()

    spec = TritonServerSpec(repository=mirror, model_control_mode="explicit", load_models=(NAME,))
    server = TritonServer(spec, tmp_path / "logs", prepared_triton)
    server.start()
    try:
        http = httpclient.InferenceServerClient(server.http_address)
        # the folder of version 2 is listed, but the config names complete versions only
        assert http.is_model_ready(NAME, "1") and not http.is_model_ready(NAME, "2")

        third = export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
        assert third.published.version == 3
        _mirror(client, repo, mirror)
        result = rollout(ObjectStateStore(repo.url, client), NAME, 3, static_servers([server.http_url]))
        assert result.state.served == [3] and result.state.versions[1].state == "retired"
        assert http.is_model_ready(NAME, "3") and not http.is_model_ready(NAME, "2")
    finally:
        server.stop()


def test_a_publisher_whose_listing_missed_a_rivals_claim_gets_412_and_takes_the_next_number(
    small_artifact: Path, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conditional create is what keeps numbers unique, not the listing: a rival claims 2
    between this publisher's listing and its claim; the store answers 412 and it takes 3."""
    from botocore.exceptions import ClientError

    import repository.object_publish as object_publish
    import repository.s3 as s3

    client = s3_client()
    repo = _bucket(client, "raced")
    export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
    rival = repo.key(NAME, CLAIMS, 2)
    client.put_object(Bucket=repo.bucket, Key=rival, Body=b"", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:  # the store itself refuses a second create
        client.put_object(Bucket=repo.bucket, Key=rival, Body=b"", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412

    listed = object_publish._claimed
    monkeypatch.setattr(object_publish, "_claimed", lambda c, r, n: listed(c, r, n) - {2})  # a stale listing
    statuses: list[int] = []
    put = client.put_object

    def recording_put(**kwargs: Any) -> Any:
        try:
            return put(**kwargs)
        except ClientError as exc:
            statuses.append(exc.response["ResponseMetadata"]["HTTPStatusCode"])
            raise

    monkeypatch.setattr(s3, "s3_client", lambda endpoint=None: client)
    monkeypatch.setattr(client, "put_object", recording_put)
    published = export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
    assert statuses == [412] and published.published.version == 3
    assert published_versions(repo, NAME) == [1, 3] and _objects(client, repo, NAME, 2) == {}
    assert _pinned(client, repo) == [1]  # published, not served: a rollout away


def test_two_publishers_at_once_take_distinct_numbers_and_the_config_names_complete_versions(
    small_artifact: Path, s3_env: dict[str, str]
) -> None:
    client = s3_client()
    repo = _bucket(client, "together")
    export_artifact(small_artifact, repo.url, NAME, tensorrt="off")
    cmd = [sys.executable, "-m", "skewserve", "export", "--artifact", str(small_artifact)]
    procs = [
        subprocess.Popen(
            [*cmd, "--repo", repo.url, "--name", NAME, "--tensorrt", "off"],
            env={**os.environ, **s3_env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    versions = sorted(int(o.split("published lt version ", 1)[1].split()[0]) for o in outs)
    assert versions == [2, 3]
    assert published_versions(repo, NAME) == [1, 2, 3]
    for v in (1, 2, 3):
        assert set(_objects(client, repo, NAME, v)) == VERSION_FILES
    for config in ("config.pbtxt", "configs/local.pbtxt"):
        pinned = _pinned(client, repo, config)
        assert pinned == [1], (config, pinned)  # publishing never changes what is served
    # both publishers' conditional writes of the desired state landed: neither lost the other's
    state = ObjectStateStore(repo.url, client).current(NAME)
    assert state is not None and {v: r.state for v, r in state.versions.items()} == {
        1: "promoted",
        2: "published",
        3: "published",
    }
