"""The serving backend is kept per model on object storage too (moto's S3 server, a real process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.pipeline import export_artifact
from exporter.triton_config import ConfigOptions
from repository.errors import PublishError
from repository.s3 import ObjectRepository, published_versions, s3_client
from tests.deploy.conftest import s3_env, s3_server  # noqa: F401  (fixtures)


def test_backend_change_on_object_storage(small_artifact: Path, s3_env: dict[str, str]) -> None:  # noqa: F811
    client = s3_client()
    client.create_bucket(Bucket="backends")
    repo = ObjectRepository.parse("s3://backends/models")
    export_artifact(small_artifact, repo.url, "m", tensorrt="off")
    body = client.get_object(Bucket=repo.bucket, Key=repo.key("m", "serving_backend.json"))["Body"].read()
    assert json.loads(body) == {"backend": "onnxruntime"}
    with pytest.raises(PublishError, match="m is served with the onnxruntime backend"):
        export_artifact(small_artifact, repo.url, "m", fmt="torchscript")
    with pytest.raises(PublishError, match=r"versions \[1\] stay live .* \(version 1 has no model.pt\)"):
        export_artifact(small_artifact, repo.url, "m", fmt="torchscript", change_backend=True)
    assert published_versions(repo, "m", client) == [1]
    # served versions stay live whatever the new config keeps: desired state serves version 1
    with pytest.raises(
        PublishError, match=r"versions \[1\] stay live \(the model's desired state serves them\)"
    ):
        export_artifact(
            small_artifact,
            repo.url,
            "m",
            fmt="torchscript",
            change_backend=True,
            options=ConfigOptions(keep_versions=1),
        )
    body = client.get_object(Bucket=repo.bucket, Key=repo.key("m", "serving_backend.json"))["Body"].read()
    assert json.loads(body) == {"backend": "onnxruntime"} and published_versions(repo, "m", client) == [1]
