"""A canary of TensorRT plans built version-compatible is refused on servers not started to load
them, and passes that check once the controller is told they are (`--servers-version-compatible`,
with `--backend-config=tensorrt,version-compatible=true` on the servers): asked of a real Triton."""

from __future__ import annotations

from pathlib import Path

from controller.canary import plan_refusal
from controller.config import ControllerConfig
from controller.triton_admin import TritonAdmin
from exporter.plans import PlanRecord, TensorRTBuild, plan_filename
from exporter.target import TARGET
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import KEY, controlled_server


def test_version_compatible_plans_are_refused_unless_the_servers_load_them(
    prepared_triton: PreparedTriton, tmp_path: Path
) -> None:
    (tmp_path / "repo").mkdir()
    server = controlled_server(tmp_path / "repo", "t", tmp_path / "logs", prepared_triton).start()
    admin = TritonAdmin("t", server.http_address, KEY, 10.0)
    build = TensorRTBuild(
        version=TARGET.tensorrt_version,
        plans=[PlanRecord(file=plan_filename("8.6", False), gpu="NVIDIA A10G", compute_capability="8.6")],
        version_compatible=True,
    )
    card = {"export": {"tensorrt": build.model_dump()}}
    try:
        refused = plan_refusal(admin, "m", card, ControllerConfig(gpu_capabilities=("8.6",)))
        assert refused is not None and "--servers-version-compatible" in refused
        assert "--backend-config=tensorrt,version-compatible=true" in refused
        told = ControllerConfig(gpu_capabilities=("8.6",), servers_version_compatible=True)
        assert (
            plan_refusal(admin, "m", card, told) is None
        )  # the server's Triton, its TensorRT, the GPU: all fit
        plain = {"export": {"tensorrt": build.model_copy(update={"version_compatible": False}).model_dump()}}
        assert plan_refusal(admin, "m", plain, ControllerConfig(gpu_capabilities=("8.6",))) is None
    finally:
        admin.close()
        server.stop()
