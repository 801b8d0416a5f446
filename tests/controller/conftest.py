"""Real tritonservers as the controller runs them: explicit model control, no --load-model, the
model-repository API closed to all but the control key, --strict-readiness=false."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from controller.api_auth import CallerTokens
from controller.config import ControllerConfig
from controller.fleet import ControlledServer, FleetSpec
from controller.runner import ControllerThread
from controller.triton_admin import TritonAdmin, restricted_api_args
from gateway.config import RegionConfig, ServerConfig
from repository.disk_store import DiskStateStore
from repository.state_store import StateStore
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway

KEY = "test-control-key"
GATEWAY_TOKEN = "test-gateway-token-0123456789"
# Short passes; a lapsed lease lets a restarted controller resume a killed one's canary at once.
CFG = ControllerConfig(interval_s=0.2, lease_s=0.5, retry_after_s=0.2, load_timeout_s=120)


def controlled_server(
    repo: Path, name: str, log_dir: Path, prepared: PreparedTriton, **spec: object
) -> TritonServer:
    return TritonServer(
        TritonServerSpec(
            repository=repo,
            name=name,
            model_control_mode="explicit",
            extra_args=("--strict-readiness=false", *restricted_api_args(KEY)),
            **spec,  # type: ignore[arg-type]
        ),
        log_dir,
        prepared,
    )


def two_versions(artifact: Path, repo: Path, model: str = "lt") -> DiskStateStore:
    """`model` published twice from `artifact` (version 1 served, 2 published) and its store."""
    from exporter.pipeline import export_artifact

    for _ in range(2):
        export_artifact(artifact, repo, model, tensorrt="off")
    return DiskStateStore(repo)


def as_controlled(servers: list[TritonServer]) -> Callable[[], list[ControlledServer]]:
    """The servers as discovery reports them: by a stable name, at their current address."""
    return lambda: [ControlledServer(s.spec.name, s.spec.region, s.http_url) for s in list(servers)]


def loaded(server: TritonServer) -> dict[str, list[int]]:
    admin = TritonAdmin(server.spec.name, server.http_address, "", 10.0)
    try:
        return admin.loaded()
    finally:
        admin.close()


@contextlib.contextmanager
def controller_and_gateway(
    servers: list[TritonServer],
    store: StateStore,
    cfg: ControllerConfig,
    workdir: Path,
    cold_start: bool = False,
    traffic: dict[str, Any] | None = None,
) -> Iterator[tuple[ControllerThread, GatewayUnderTest]]:
    """The controller over `servers` (one region, `r`) with its API, after its first pass, and a
    gateway asking it for cold models (`cold_start`) and following its traffic plans (`traffic`)."""
    fleet = FleetSpec(
        [
            RegionConfig(
                name="r",
                servers=[
                    ServerConfig(name=s.spec.name, http=s.http_address, grpc=s.grpc_address) for s in servers
                ],
            )
        ]
    )
    thread = ControllerThread(fleet, store, KEY, cfg).start()
    gw = None
    try:
        tokens = workdir / "controller-tokens"  # the gateways authenticate as in deploy/
        tokens.mkdir(parents=True, exist_ok=True)
        (tokens / "gateway-r").write_text(GATEWAY_TOKEN)
        url = f"http://127.0.0.1:{thread.serve_demand('127.0.0.1', 0, CallerTokens(tokens))}"
        assert thread.wait_first_pass(120)
        ask = {"controller_url": url, "token_file": str(tokens / "gateway-r")}
        extra: dict[str, Any] = {}
        if cold_start:
            extra["cold_start"] = ask
        if traffic is not None:
            extra["traffic"] = {**ask, **traffic}
        gw = launch_gateway(gateway_config({"r": servers}, home="r", cache={"models": []}, **extra), workdir)
        yield thread, gw
    finally:
        if gw is not None:
            gw.stop()
        thread.stop()
