"""Rollout of a version with TensorRT plans against a real server: refused before anything loads.

No GPU here, so the plan version is a real export whose model card then records a plan build, as
a GPU export writes it (exporter/plans.py `TensorRTBuild`); the check reads only the card and what
the server reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from controller.config import ControllerConfig
from controller.errors import RolloutError
from controller.rollout import rollout as rollout_to
from controller.rollout import static_servers
from exporter.pipeline import export_artifact
from exporter.plans import PlanRecord, TensorRTBuild
from exporter.target import TARGET
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec


def rollout(
    name: str,
    version: int,
    urls: list[str],
    repo: Path,
    server_tensorrt: str | None = None,
    gpu_capabilities: list[str] = (),  # type: ignore[assignment]
) -> list[str]:
    cfg = ControllerConfig(server_tensorrt=server_tensorrt, gpu_capabilities=tuple(gpu_capabilities))
    return rollout_to(DiskStateStore(repo), name, version, static_servers(urls), cfg=cfg).steps


def _record_plans(version_dir: Path, build: TensorRTBuild) -> None:
    card_path = version_dir / "model_card.json"
    card = json.loads(card_path.read_text())
    card["export"]["tensorrt"] = build.model_dump()
    card_path.write_text(json.dumps(card))


@pytest.mark.slow
def test_plan_version_is_refused_by_what_the_server_reports(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    v2 = export_artifact(small_artifact, repo, "lt", tensorrt="off").published.path
    build = TensorRTBuild(
        version=TARGET.tensorrt_version,
        plans=[PlanRecord(file="model.plan", gpu="NVIDIA A10G", compute_capability="8.6")],
    )
    _record_plans(v2, build)
    cold = TritonServer(
        TritonServerSpec(repository=repo, name="cold", model_control_mode="explicit", load_models=()),
        tmp_path / "logs",
        prepared_triton,
    )
    warm = TritonServer(
        TritonServerSpec(repository=repo, name="warm", model_control_mode="explicit", load_models=("lt",)),
        tmp_path / "logs",
        prepared_triton,
    )
    with cold, warm:
        client = httpclient.InferenceServerClient(cold.http_address)
        reported = client.get_server_metadata()["version"]
        trt_of_server = TARGET.tensorrt_version if reported == TARGET.triton_version else "10.5.0"
        # cold has not loaded lt, so it may load the GPU profile: the plans must suit it
        with pytest.raises(RolloutError) as refused:
            rollout(
                "lt",
                2,
                [cold.http_url],
                repo,
                server_tensorrt=None if reported == TARGET.triton_version else "10.5.0",
            )
        assert str(refused.value) == (
            f"{cold.http_url}: refusing to roll out lt version 2, the server cannot load its TensorRT plans: "
            "the version's TensorRT plans run on compute capability 8.6, and the servers' GPUs are not known: "
            "pass --gpu-capability (e.g. 7.5 T4, 8.0 A100, 8.6 A10G, 8.9 L4, 9.0 H100); nothing was loaded"
        )
        with pytest.raises(
            RolloutError,
            match="the version has plans for compute capability 8.6, but the server's GPU has compute capability 7.5",
        ):
            rollout("lt", 2, [cold.http_url], repo, server_tensorrt=trt_of_server, gpu_capabilities=["7.5"])
        # a plan built by another TensorRT than the one the server reports (Triton 2.51.0 = NGC 24.10)
        _record_plans(v2, build.model_copy(update={"version": "10.3.0"}))
        with pytest.raises(
            RolloutError,
            match=f"built with TensorRT 10.3.0 and loads only on that version, but the server runs TensorRT {trt_of_server}",
        ):
            rollout(
                "lt",
                2,
                [cold.http_url],
                repo,
                gpu_capabilities=["8.6"],
                server_tensorrt=None if reported == TARGET.triton_version else "10.5.0",
            )
        assert [m for m in client.get_model_repository_index() if m.get("state") == "READY"] == []
        # the command's options reach the check: with the server's TensorRT stated as the plan's own,
        # only the stated GPU capability is left to refuse it
        res = subprocess.run(
            [sys.executable, "-m", "skewserve", "rollout", "lt", "--version", "2", "--repo", str(repo),
             "--servers", cold.http_url, "--server-tensorrt", "10.3.0", "--gpu-capability", "7.5"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert res.returncode == 1, res.stdout + res.stderr
        assert "rollout failed:" in res.stdout and "refusing to roll out lt version 2" in res.stdout
        assert (
            "the version has plans for compute capability 8.6, but the server's GPU has compute capability 7.5"
            in res.stdout
        )

        # warm serves lt with the local CPU profile (Python backend on model.onnx): plans do not apply,
        # and its canary is held to the CPU limit the card states
        steps = rollout("lt", 2, [warm.http_url], repo)
        assert len(steps) == 1 and "(limit 1e-04, CPU)" in steps[0], steps
        assert httpclient.InferenceServerClient(warm.http_address).is_model_ready("lt", "2")
