"""Repository hygiene: versions neither served, in canary, nor among the newest kept are removed,
on disk and on S3 (moto's server, a real process); the desired state forgets them."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from controller.config import ControllerConfig
from controller.reconcile import Controller, PassReport
from repository.desired_state import DesiredState
from repository.disk_store import DiskStateStore
from repository.model_config import parse
from repository.object_store import ObjectStateStore
from repository.s3 import s3_client
from repository.state_store import StateStore
from tests.deploy.conftest import s3_env, s3_server  # noqa: F401  (fixtures)

CONFIG = 'name: "m"\nversion_policy { latest { num_versions: 1 } }\nmax_batch_size: 8\nbackend: "python"\n'


def _prune_everything_but_the_served_and_the_newest(store: StateStore) -> None:
    for v in range(1, 6):
        store.update("m", partial(DesiredState.published, version=v))
    store.update("m", partial(DesiredState.promote, version=3))
    controller = Controller(store, lambda: [], "", ControllerConfig(keep_versions=1))
    report = PassReport()
    state = store.current("m")
    assert state is not None
    controller.prune(state, report)
    assert report.removed == ["m version 1", "m version 2", "m version 4"]
    assert store.published_versions("m") == [3, 5]
    state = store.current("m")
    assert state is not None and sorted(state.versions) == [3, 5] and state.served == [3]
    assert all(
        list(parse(text).version_policy.specific.versions) == [3] for text in store.configs("m").values()
    )


def test_hygiene_on_disk(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "configs").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "configs" / "local.pbtxt").write_text(CONFIG)
    for v in range(1, 6):
        (model / str(v)).mkdir()
        (model / str(v) / "model.onnx").write_bytes(b"weights")
        (model / str(v) / "model_card.json").write_text("{}")
    _prune_everything_but_the_served_and_the_newest(DiskStateStore(tmp_path))
    assert sorted(p.name for p in model.iterdir() if not p.name.startswith(".")) == [
        "3",
        "5",
        "config.pbtxt",
        "configs",
        "desired_state.json",
    ]


def test_hygiene_on_object_storage(s3_env: dict[str, str]) -> None:  # noqa: F811
    client: Any = s3_client()
    client.create_bucket(Bucket="hygiene")
    for key in ("config.pbtxt", "configs/local.pbtxt"):
        client.put_object(Bucket="hygiene", Key=f"models/m/{key}", Body=CONFIG.encode())
    for v in range(1, 6):
        for name in ("model.onnx", "model_card.json"):
            client.put_object(Bucket="hygiene", Key=f"models/m/{v}/{name}", Body=b"{}")
    _prune_everything_but_the_served_and_the_newest(ObjectStateStore("s3://hygiene/models", client))
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="hygiene", Prefix="models/m/")["Contents"]]
    assert sorted({k.split("/")[2] for k in keys}) == [
        "3",
        "5",
        "config.pbtxt",
        "configs",
        "desired_state.json",
    ]
