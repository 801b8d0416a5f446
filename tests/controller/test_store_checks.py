"""Issue 34, item 7: the controller checks its store before it acts. Against moto's S3 server (a
real process): the repository named as Triton names an S3-compatible store (`s3://host:port/bucket`,
no endpoint in the environment) is read and written; a store that honours conditional writes passes
the probe, and one that ignores `If-None-Match` or `If-Match` makes `skewserve controller` refuse to
run, naming the store and the condition."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.store_probe import UnsafeStore, check_conditional_writes
from repository.desired_state import DesiredState
from repository.errors import StateConflict
from repository.object_store import ObjectStateStore
from repository.s3 import ObjectRepository, s3_client
from tests.deploy.conftest import CREDENTIALS, S3Server, s3_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


class IgnoringConditions:
    """An S3 client that drops the conditions of its PUTs, as some S3-compatible servers do."""

    def __init__(self, client: Any, drop: str) -> None:
        self._client, self._drop = client, drop

    def put_object(self, **kwargs: Any) -> Any:
        kwargs.pop(self._drop, None)
        return self._client.put_object(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.fixture()
def credentials_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)


def test_an_s3_compatible_store_named_as_triton_names_it_and_probed(
    s3_server: S3Server,  # noqa: F811
    credentials_only: None,
    tmp_path: Path,
) -> None:
    hostport = s3_server.endpoint.removeprefix("http://")
    url = f"s3://{hostport}/probed/models"
    repo = ObjectRepository.parse(url)
    assert repo.url == url and repo.endpoint == s3_server.endpoint
    repo.client().create_bucket(Bucket="probed")
    store = ObjectStateStore(url)
    check_conditional_writes(store)  # moto honours both conditions
    assert store.models() == []  # the probe left nothing a reader would take for a model
    state = DesiredState(model="m").published(1)
    store.write(state, None)
    assert store.read("m")[0] == state and store.models() == ["m"]

    # model-level files are written conditionally too (controller/state_store.py `materialize`)
    store.write_config("m", "labels.txt", "a\n", None)
    token = store.model_file_token("m", "labels.txt")
    for stale in (None, '"00000000000000000000000000000000"'):
        with pytest.raises(StateConflict, match="labels.txt changed since it was read"):
            store.write_config("m", "labels.txt", "b\n", stale)
    store.write_config("m", "labels.txt", "c\n", token)
    assert store.model_file("m", "labels.txt") == "c\n"

    for drop, condition in (("IfNoneMatch", "If-None-Match"), ("IfMatch", "If-Match")):
        careless = ObjectStateStore(url, IgnoringConditions(repo.client(), drop))
        with pytest.raises(UnsafeStore, match=f"store at {url} ignored {condition}"):
            check_conditional_writes(careless)

    # the command refuses a store it cannot probe, before it touches any server
    config = tmp_path / "gateway.yaml"
    config.write_text(
        '{"regions": [{"name": "r", "servers": [{"name": "s", "http": "127.0.0.1:9", "grpc": "127.0.0.1:9"}]}]}'
    )
    missing = f"s3://{hostport}/no-such-bucket"
    res = subprocess.run(
        [sys.executable, "-m", "skewserve", "controller", "--config", str(config), "--repo", missing],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert res.returncode == 2, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert f"model repository {missing}:" in out and "NoSuchBucket" in out, out


def test_every_s3_call_is_bounded() -> None:
    """A hung store call must not stall a pass or a lease renewal for botocore's default 60 s a try
    (`make chaos` saw 49 s take-overs): the client the repository opens bounds each call."""
    config = s3_client("http://127.0.0.1:9").meta.config
    assert (config.connect_timeout, config.read_timeout) == (5, 15)
    assert (config.retries["total_max_attempts"], config.retries["mode"]) == (3, "standard")
