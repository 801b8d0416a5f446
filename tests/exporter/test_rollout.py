"""Rollout onto two live servers under client traffic; a broken version rolls back."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from exporter.errors import RolloutError
from exporter.pipeline import export_artifact
from exporter.rollout import rollout
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec


def _copy_with_scaled_weights(src: Path, dest: Path, factor: float) -> None:
    """A complete version whose ONNX weights are all scaled: it loads and serves, with other outputs."""
    import onnx
    from onnx import numpy_helper

    shutil.copytree(src, dest)
    model = onnx.load(str(dest / "model.onnx"))
    for init in model.graph.initializer:
        w = numpy_helper.to_array(init)
        if w.dtype.kind == "f":
            init.CopyFrom(numpy_helper.from_array((w * factor).astype(w.dtype), init.name))
    onnx.save(model, str(dest / "model.onnx"))


@pytest.mark.slow
def test_rollout_with_live_traffic_then_broken_version_rolls_back(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    specs = [
        TritonServerSpec(repository=repo, name=f"s{i}", model_control_mode="explicit", load_models=("lt",))
        for i in range(2)
    ]
    servers = [TritonServer(s, tmp_path / "logs", prepared_triton) for s in specs]
    for s in servers:
        s.start()
    try:
        export_artifact(small_artifact, repo, "lt", tensorrt="off")  # version 2, not loaded yet
        stop = threading.Event()
        results = {"ok": 0, "failed": []}
        x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)

        def client_loop(address: str) -> None:
            client = httpclient.InferenceServerClient(address)
            while not stop.is_set():
                inp = httpclient.InferInput("features", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                try:
                    client.infer("lt", [inp])
                    results["ok"] += 1
                except Exception as exc:  # every failure is recorded, none ignored
                    results["failed"].append(repr(exc))

        threads = [threading.Thread(target=client_loop, args=(s.http_address,)) for s in servers]
        for t in threads:
            t.start()
        urls = [s.http_url for s in servers]
        done = rollout("lt", 2, urls, repo)
        stop.set()
        for t in threads:
            t.join()
        assert results["failed"] == [] and results["ok"] > 0
        assert [d.previous_versions for d in done] == [["1"], ["1"]]
        for s in servers:
            c = httpclient.InferenceServerClient(s.http_address)
            assert c.is_model_ready("lt", "2")
            assert c.get_model_metadata("lt")["versions"] == ["1", "2"]

        # a broken version 3: published files intact, weights corrupted
        shutil.copytree(repo / "lt" / "2", repo / "lt" / "3")
        (repo / "lt" / "3" / "model.onnx").write_bytes(b"not an onnx model")
        with pytest.raises(RolloutError, match=rf"(?s)^{urls[0]}: .*pinned back to version\(s\) 1, 2"):
            rollout("lt", 3, urls, repo)
        c0 = httpclient.InferenceServerClient(servers[0].http_address)
        assert c0.is_model_ready("lt", "2") and not c0.is_model_ready("lt", "3")
        inp = httpclient.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        c0.infer("lt", [inp])  # still serving
        assert not httpclient.InferenceServerClient(servers[1].http_address).is_model_ready(
            "lt", "3"
        )  # never reached

        # a wrong version 4: loads and answers, but not what the exporter recorded (weights scaled);
        # the unloadable version 3 is withdrawn from the repository first, as an operator would
        shutil.rmtree(repo / "lt" / "3")
        _copy_with_scaled_weights(repo / "lt" / "2", repo / "lt" / "4", factor=3.0)
        with pytest.raises(
            RolloutError,
            match=rf"(?s)^{urls[0]}: canary for lt version 4 differs from the exporter's reference by .*"
            r"pinned back to version\(s\) 1, 2",
        ):
            rollout("lt", 4, urls, repo)
        for s in servers:
            c = httpclient.InferenceServerClient(s.http_address)
            assert c.is_model_ready("lt", "2") and not c.is_model_ready("lt", "4")
        c0.infer("lt", [inp])  # still serving
    finally:
        for s in servers:
            s.stop()


def test_rollout_of_unpublished_version_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RolloutError, match="lt version 9 is not published"):
        rollout("lt", 9, ["http://127.0.0.1:1"], tmp_path)


def test_rollout_cli_takes_servers_from_the_gateway_config(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "home_region": "a",
                "regions": [
                    {"name": "a", "servers": [{"name": "a0", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}
                ],
            }
        )
    )
    base = [sys.executable, "-m", "skewserve.cli", "rollout", "lt", "--version", "1", "--repo", str(tmp_path)]
    res = subprocess.run([*base, "--regions", "b", "--config", str(cfg)], capture_output=True, text=True)
    assert res.returncode == 2 and "regions ['b'] are not in" in res.stdout + res.stderr
    res = subprocess.run([*base, "--regions", "a", "--config", str(cfg)], capture_output=True, text=True)
    assert res.returncode == 1 and "lt version 1 is not published" in res.stdout
    res = subprocess.run([*base, "--regions", "a"], capture_output=True, text=True)
    assert res.returncode == 2 and "--regions needs --config" in res.stdout + res.stderr
