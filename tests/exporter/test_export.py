"""Export artifacts and serve them with a real local tritonserver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from exporter.contract import ServingContract
from exporter.errors import ParityError
from exporter.graph import ServingModule
from exporter.parity import compare, require, torch_runner
from exporter.pipeline import export_artifact
from exporter.tensorrt_build import tensorrt_unavailable_reason
from exporter.triton_config import ConfigOptions, gpu_config, local_config
from repository.disk import published_versions
from repository.errors import PublishError
from repository.model_config import parse, render
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from training.artifact import load_model


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, 8)) * 20).astype(np.float32)


def _reference(artifact: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    model, _ = load_model(artifact)
    logits, probs, label = ServingModule(model)(torch.from_numpy(x))
    return {
        "logits": logits.detach().numpy(),
        "probabilities": probs.detach().numpy(),
        "label": label.numpy(),
    }


@pytest.fixture(scope="module")
def served(small_artifact: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton):
    repo = tmp_path_factory.mktemp("repo")
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    export_artifact(small_artifact, repo, "lt16", precision="fp16", tensorrt="off")
    export_artifact(small_artifact, repo, "lt8", precision="int8")
    server = TritonServer(
        TritonServerSpec(repository=repo, name="exp"), tmp_path_factory.mktemp("logs"), prepared_triton
    )
    with server:
        yield server, repo


def test_http_and_grpc_outputs_equal_pytorch(served, small_artifact: Path) -> None:
    server, _ = served
    x = _rows(5)
    want = _reference(small_artifact, x)
    h = httpclient.InferenceServerClient(server.http_address)
    for binary in (True, False):
        inp = httpclient.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = h.infer("lt", [inp])
        np.testing.assert_allclose(out.as_numpy("probabilities"), want["probabilities"], atol=1e-5)
        np.testing.assert_allclose(out.as_numpy("logits"), want["logits"], atol=1e-4, rtol=1e-5)
        np.testing.assert_array_equal(out.as_numpy("label"), want["label"])
    g = grpcclient.InferenceServerClient(server.grpc_address)
    ginp = grpcclient.InferInput("features", list(x.shape), "FP32")
    ginp.set_data_from_numpy(x)
    gout = g.infer("lt", [ginp])
    np.testing.assert_allclose(gout.as_numpy("probabilities"), want["probabilities"], atol=1e-5)
    np.testing.assert_array_equal(gout.as_numpy("label"), want["label"])
    half = g.infer("lt16", [ginp])
    assert half.as_numpy("probabilities").dtype == np.float32  # FP32 at the boundary
    np.testing.assert_allclose(half.as_numpy("probabilities"), want["probabilities"], atol=1e-2)


def test_an_int8_version_is_served_and_gated_on_agreement_per_class(
    served, small_artifact: Path, small_data: Path
) -> None:
    """Issue 35 item 3: the INT8 graph answers from a real tritonserver; its card has the gate's figures."""
    import json

    import pandas as pd

    server, repo = served
    # In-distribution rows: the INT8 graph's ranges are calibrated on the validation split.
    x = pd.read_parquet(small_data / "test.parquet").drop(columns="label").to_numpy(np.float32)[:64]
    want = _reference(small_artifact, x)
    g = grpcclient.InferenceServerClient(server.grpc_address)
    inp = grpcclient.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = g.infer("lt8", [inp])
    assert out.as_numpy("probabilities").dtype == np.float32  # FP32 at the boundary
    np.testing.assert_allclose(out.as_numpy("probabilities").sum(axis=1), 1.0, atol=1e-4)
    assert (out.as_numpy("label").reshape(-1) == want["label"].reshape(-1)).mean() >= 0.9
    card = json.loads((repo / "lt8" / "1" / "model_card.json").read_text())
    assert card["export"]["precision"] == "int8" and card["export"]["tensorrt"] is None
    gate = card["parity"][-1]
    assert gate["precision"] == "int8" and gate["passed"] and gate["argmax_agreement"] >= 0.98
    classes = card["artifact"]["metadata"]["classes"]
    assert list(gate["per_class_agreement"]) == classes
    assert sum(v["rows"] for v in gate["per_class_agreement"].values()) == gate["rows"]
    gpu = parse((repo / "lt8" / "config.pbtxt").read_text())
    assert gpu.backend == "onnxruntime" and gpu.instance_group[0].kind == gpu.instance_group[0].KIND_CPU


def test_int8_refuses_tensorrt(small_artifact: Path, tmp_path: Path) -> None:
    from exporter.errors import ExportError

    with pytest.raises(ExportError, match="--precision int8 is an ONNX Runtime CPU graph"):
        export_artifact(small_artifact, tmp_path, "m", precision="int8", tensorrt="on")


def test_the_served_config_names_the_feature_order(served) -> None:
    """Issue 25 item 11: clients learn what each position of `features` is from Triton itself."""
    server, _ = served
    config = httpclient.InferenceServerClient(server.http_address).get_model_config("lt")
    assert config["parameters"]["feature_names"]["string_value"] == ",".join(f"f{i:02d}" for i in range(8))


def test_classification_extension_returns_class_names(served, small_artifact: Path) -> None:
    server, _ = served
    x = _rows(2, seed=1)
    want = _reference(small_artifact, x)["probabilities"]
    _, meta = load_model(small_artifact)
    h = httpclient.InferenceServerClient(server.http_address)
    inp = httpclient.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = h.infer("lt", [inp], outputs=[httpclient.InferRequestedOutput("probabilities", class_count=2)])
    top = out.as_numpy("probabilities")
    for row, entries in enumerate(top):
        score, index, name = entries[0].decode().split(":")
        assert int(index) == int(want[row].argmax())
        assert name == meta["classes"][int(index)]
        assert abs(float(score) - want[row].max()) < 1e-4


def test_every_written_config_parses_against_the_schema(served) -> None:
    _, repo = served
    for path in list(repo.glob("*/config.pbtxt")) + list(repo.glob("*/configs/*.pbtxt")):
        cfg = parse(path.read_text())
        assert cfg.max_batch_size == 64 and list(cfg.version_policy.specific.versions) == [1]
    gpu = parse((repo / "lt" / "config.pbtxt").read_text())
    assert gpu.backend == "onnxruntime" and gpu.instance_group[0].kind == gpu.instance_group[0].KIND_GPU
    assert list(gpu.dynamic_batching.preferred_batch_size) == [8, 32] and gpu.model_warmup
    assert (repo / "lt" / "labels.txt").read_text().splitlines() == load_model_classes(repo)


def load_model_classes(repo: Path) -> list[str]:
    import json

    return json.loads((repo / "lt" / "1" / "model_card.json").read_text())["artifact"]["metadata"]["classes"]


def test_config_options_reach_the_config() -> None:
    contract = ServingContract.table(3, ("a", "b"))
    opts = ConfigOptions(
        max_batch_size=16,
        preferred_batch_sizes=[4, 32],
        max_queue_delay_us=250,
        gpu_instances=2,
        keep_versions=3,
        response_cache=True,
        warmup_batch=4,
        ort_threads=2,
    )
    gpu = parse(render(gpu_config("m", contract, opts, tensorrt_plan=True)))
    assert gpu.platform == "tensorrt_plan" and gpu.default_model_filename == "model.plan"
    assert gpu.max_batch_size == 16 and list(gpu.dynamic_batching.preferred_batch_size) == [4]
    assert gpu.dynamic_batching.max_queue_delay_microseconds == 250 and gpu.instance_group[0].count == 2
    assert gpu.version_policy.latest.num_versions == 3 and gpu.response_cache.enable
    assert gpu.model_warmup[0].batch_size == 4
    local = parse(render(local_config("m", contract, opts)))
    assert local.backend == "python" and local.parameters["intra_op_threads"].string_value == "2"


def test_parity_failure_refuses_with_figures(small_artifact: Path) -> None:
    model, _ = load_model(small_artifact)
    ref = torch_runner(ServingModule(model))

    def skewed(x: tuple[np.ndarray, ...]) -> dict[str, np.ndarray]:
        out = ref(x)
        return out | {"probabilities": out["probabilities"] + 1e-3}

    report = compare(ref, skewed, [(_rows(4),)], "onnxruntime", "fp32")
    with pytest.raises(
        ParityError, match=r"parity failed for onnxruntime fp32: max \|Δp\| 1.00e-03 \(limit 1e-04\)"
    ):
        require(report)


def test_versions_are_immutable_and_numbered(small_artifact: Path, tmp_path: Path) -> None:
    assert export_artifact(small_artifact, tmp_path, "m", tensorrt="off").published.version == 1
    assert export_artifact(small_artifact, tmp_path, "m", version=5, tensorrt="off").published.version == 5
    with pytest.raises(
        PublishError, match="m version 5 already exists; versions are immutable: omit --version to take 6"
    ):
        export_artifact(small_artifact, tmp_path, "m", version=5, tensorrt="off")
    assert export_artifact(small_artifact, tmp_path, "m", tensorrt="off").published.version == 6


def test_concurrent_exports_take_distinct_versions(small_artifact: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "skewserve",
        "export",
        "--artifact",
        str(small_artifact),
        "--repo",
        str(tmp_path),
        "--name",
        "m",
        "--tensorrt",
        "off",
    ]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(3)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert published_versions(tmp_path / "m") == [1, 2, 3]


def test_tensorrt_on_without_gpu_is_a_clear_error(small_artifact: Path, tmp_path: Path) -> None:
    """Run on every host: the export runs with the GPU hidden (CUDA_VISIBLE_DEVICES empty), as on a
    CPU-only host, so a machine with a GPU tests this path too."""
    res = subprocess.run(
        [*_export_cli(small_artifact, tmp_path), "--tensorrt", "on"],
        capture_output=True,
        text=True,
        env=_without_gpu(),
        timeout=240,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert (
        "error: --tensorrt on, but no CUDA GPU on this machine; use --tensorrt auto or off on this machine"
        in " ".join(res.stdout.split())
    ), res.stdout + res.stderr
    assert not (tmp_path / "m").exists() or published_versions(tmp_path / "m") == []


def _export_cli(artifact: Path, repo: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "skewserve",
        "export",
        "--artifact",
        str(artifact),
        "--repo",
        str(repo),
        "--name",
        "m",
    ]


def _without_gpu() -> dict[str, str]:
    """This environment with every CUDA device hidden from the process (torch then sees none)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.gpu
@pytest.mark.skipif(
    tensorrt_unavailable_reason() is not None,
    reason=f"TensorRT path needs a CUDA GPU: {tensorrt_unavailable_reason()}",
)
def test_tensorrt_plan_builds_and_matches_onnxruntime(small_artifact: Path, tmp_path: Path) -> None:
    result = export_artifact(small_artifact, tmp_path, "m", precision="fp16", tensorrt="on")
    assert result.tensorrt and (result.published.path / "model.plan").is_file()
    assert result.parity[-1].target == "tensorrt model.plan" and result.parity[-1].passed
    assert list(tmp_path.glob(".tensorrt_timing_cache.sm*"))  # one timing cache per GPU capability
    assert parse((tmp_path / "m" / "config.pbtxt").read_text()).platform == "tensorrt_plan"


def test_exports_in_one_process_build_one_torchlib_registry_and_write_the_same_graph(
    small_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.onnx._internal.exporter import _registration

    from exporter import onnx_export

    monkeypatch.setattr(onnx_export._TORCHLIB_REGISTRIES, "built", {})  # the first export builds it
    torchs_own = _registration.ONNXRegistry.__dict__["from_torchlib"]
    graphs = []
    built = []
    for repo in ("a", "b"):
        result = export_artifact(small_artifact, tmp_path / repo, "m", tensorrt="off")
        graphs.append((tmp_path / repo / "m" / str(result.published.version) / "model.onnx").read_bytes())
        built.append(dict(onnx_export._TORCHLIB_REGISTRIES.built))
    assert list(built[0]) == [onnx_export.OPSET]
    assert built[0][onnx_export.OPSET] is built[1][onnx_export.OPSET], "the second export built its own"
    assert graphs[0] == graphs[1]
    # Outside an export, torch.onnx builds its registry as it always does.
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is torchs_own


def test_each_export_gets_its_own_copy_of_the_shared_torchlib_registry() -> None:
    from torch.onnx._internal.exporter import _registration

    from exporter import onnx_export

    with onnx_export._TORCHLIB_REGISTRIES.in_use():
        mine = _registration.ONNXRegistry.from_torchlib(opset_version=onnx_export.OPSET)
        theirs = _registration.ONNXRegistry.from_torchlib(opset_version=onnx_export.OPSET)
        # What torch does with a caller's custom translation table: it adds to that call's registry.
        mine.register_op(torch.ops.aten.relu.default, lambda x: x, is_complex=False)
    assert mine is not theirs
    key = next(k for k in mine.functions if len(mine.functions[k]) != len(theirs.functions.get(k, [])))
    assert len(mine.functions[key]) == len(theirs.functions[key]) + 1
