"""Export from the artifact's contract: several inputs of several dtypes and dynamic lengths, text
served from raw UTF-8 through the ensemble, FP16 agreement, and a model ONNX cannot trace refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from exporter.contract import ServingContract
from exporter.errors import ExportError
from exporter.pipeline import export_artifact
from exporter.tensorrt_build import profile_shapes
from repository.model_config import parse
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from training.config import TrainConfig
from training.datasets_builtin import write_topics_lt
from training.launch import train
from training.text_preprocess import tokenize, vocabulary

MULTI = """
import torch
from torch import nn


class Mixed(nn.Module):
    def __init__(self, n_classes, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.dense = nn.Linear(4 + 3, 8)
        self.head = nn.Linear(16, n_classes)

    def forward(self, dense, flags, ids):
        keep = (ids != 0).unsqueeze(-1).float()
        pooled = (self.embed(ids.long()) * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        x = torch.cat([dense, flags.float()], dim=1)
        return self.head(torch.cat([self.dense(x), pooled], dim=1))


def build(data):
    return Mixed(len(data.classes), data.preprocessing["max_id"]["ids"] + 1)


class Branchy(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.head = nn.Linear(4, n_classes)

    def forward(self, dense, flags, ids):
        if dense.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            return self.head(dense)
        return -self.head(dense)


def branchy(data):
    return Branchy(len(data.classes))
"""


def _shards(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for split, n in (("train", 120), ("val", 40)):
        labels = rng.integers(0, 3, n)
        d = root / split
        d.mkdir(parents=True)
        np.save(d / "labels.npy", labels)
        np.save(d / "dense.npy", (rng.standard_normal((n, 4)) + labels[:, None]).astype(np.float32))
        np.save(d / "flags.npy", rng.random((n, 3)) < 0.5)
        lengths = rng.integers(1, 7, n)
        ids = np.zeros((n, 6), dtype=np.int32)
        for i, k in enumerate(lengths):
            ids[i, :k] = rng.integers(1, 30, k)
        np.save(d / "ids.npy", ids)
        np.save(d / "ids.lengths.npy", lengths)
    return root


@pytest.fixture(scope="module")
def mixed_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("mixed")
    (work / "mixed_model.py").write_text(MULTI)
    data = _shards(work / "data")
    out = work / "art"
    train(
        TrainConfig(
            data_dir=data,
            out_dir=out,
            model=f"{work}/mixed_model.py:build",
            max_steps=20,
            global_batch_size=32,
            progress=False,
        )
    )
    return out


def test_several_inputs_of_several_dtypes_export_with_dynamic_dims(
    mixed_artifact: Path, tmp_path: Path
) -> None:
    meta = json.loads((mixed_artifact / "metadata.json").read_text())
    assert [(i["name"], i["dtype"], i["shape"]) for i in meta["inputs"]] == [
        ("dense", "float32", [4]), ("flags", "bool", [3]), ("ids", "int32", [-1]),
    ]  # fmt: skip
    for fmt in ("onnx", "torchscript"):
        result = export_artifact(mixed_artifact, tmp_path, f"m_{fmt}", tensorrt="off", fmt=fmt)
        assert all(r.passed and r.rows == 40 for r in result.parity), result.parity
        cfg = parse((tmp_path / f"m_{fmt}" / "config.pbtxt").read_text())
        assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [
            ("dense", 11, [4]),
            ("flags", 1, [3]),
            ("ids", 8, [-1]),
        ]  # fmt: skip  (TYPE_FP32, TYPE_BOOL, TYPE_INT32)
        assert cfg.model_warmup[0].inputs["ids"].zero_data  # ids out of range would fail warm-up
        assert not result.raw_models  # several inputs: clients send tensors


def test_tensorrt_profiles_come_from_the_training_lengths(mixed_artifact: Path) -> None:
    meta = json.loads((mixed_artifact / "metadata.json").read_text())
    shapes = profile_shapes(ServingContract.from_metadata(meta), 64)
    lo, opt, hi = meta["inputs"][2]["ranges"][0]
    assert shapes["ids"] == ((1, lo), (32, opt), (64, hi)) and hi == 6
    assert shapes["dense"] == ((1, 4), (32, 4), (64, 4))


def test_a_model_onnx_cannot_trace_is_refused_with_the_torchscript_route(
    mixed_artifact: Path, tmp_path: Path
) -> None:
    meta = json.loads((mixed_artifact / "metadata.json").read_text())
    art = tmp_path / "branchy"
    art.mkdir()
    name = meta["model"]["name"].replace(":build", ":branchy")
    meta["model"] = {"kind": "file", "name": name, "args": {}}
    (art / "metadata.json").write_text(json.dumps(meta))
    import torch

    from training.artifact import data_spec
    from training.factory import build

    model, _ = build(name, {}, data_spec(meta))
    torch.save(model.state_dict(), art / "model.pt")
    with pytest.raises(ExportError, match=r"'.*:branchy' cannot be exported to ONNX: .*--format torchscript"):
        export_artifact(art, tmp_path / "repo", "b", tensorrt="off")
    assert not (tmp_path / "repo" / "b" / "1").exists()


@pytest.fixture(scope="module")
def topics_served(
    tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[tuple[Path, Path, TritonServer]]:
    work = tmp_path_factory.mktemp("topics")
    write_topics_lt(work / "data", n_max=150, ratio=5, val_per_class=10, test_per_class=5, max_length=24)
    train(
        TrainConfig(
            data_dir=work / "data", out_dir=work / "art", model="text", model_args={"dim": 16, "heads": 2, "layers": 1},
            max_steps=40, global_batch_size=32, progress=False,
        )
    )  # fmt: skip
    export_artifact(work / "art", work / "repo", "topics", tensorrt="off")
    half = export_artifact(work / "art", work / "repo", "topics16", tensorrt="off", precision="fp16")
    assert [r.precision for r in half.parity] == ["fp32", "fp16"] and half.parity[1].argmax_agreement >= 0.999
    server = TritonServer(
        TritonServerSpec(repository=work / "repo", name="topics"), work / "logs", prepared_triton
    )
    with server:
        yield work, work / "art", server


def test_raw_text_through_the_ensemble_equals_token_ids(topics_served) -> None:
    work, art, server = topics_served
    meta = json.loads((art / "metadata.json").read_text())
    vocab = vocabulary(meta["preprocessing"]["vocab"])
    texts = ["t2x3 w1 w4 t2x7 T2X1", "w0", "unknownword t5x2 t5x3 t5x3 w9 w9 w9", ""]
    client = httpclient.InferenceServerClient(server.http_address)
    raw = httpclient.InferInput("raw", [len(texts), 1], "BYTES")
    raw.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    got = client.infer("topics_raw", [raw])
    for i, text in enumerate(texts):  # one request per text: each with its own length
        ids = tokenize(text, vocab, 24)[None]
        t = httpclient.InferInput("tokens", list(ids.shape), "INT64")
        t.set_data_from_numpy(ids)
        want = client.infer("topics", [t])
        np.testing.assert_allclose(
            got.as_numpy("probabilities")[i], want.as_numpy("probabilities")[0], atol=1e-5
        )
    bad = httpclient.InferInput("raw", [1, 1], "BYTES")
    bad.set_data_from_numpy(np.array([[b"\xff\xfe"]], dtype=object))
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=r"raw\[0\]: text is not UTF-8"):
        client.infer("topics_raw", [bad])


def test_a_version_with_other_tensors_is_refused_naming_them_readably(
    small_artifact: Path, mixed_artifact: Path, tmp_path: Path
) -> None:
    from repository.errors import PublishError

    export_artifact(small_artifact, tmp_path, "m", tensorrt="off")
    with pytest.raises(
        PublishError,
        match=r"the new version changes m's tensors \(features FP32 \[8\] -> dense FP32 \[4\]; logits FP32 \[5\] -> "
        r"flags BOOL \[3\];",
    ):
        export_artifact(mixed_artifact, tmp_path, "m", tensorrt="off")


def test_export_prints_each_result_once(small_artifact: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "skewserve", "export", "--artifact", str(small_artifact), "--repo",
         str(tmp_path), "--name", "once", "--tensorrt", "off"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    everything = res.stdout + res.stderr
    assert everything.count("published once version 1") == 1, everything
