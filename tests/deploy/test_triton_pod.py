"""The Triton pod's own contract, against a real tritonserver (nvidia-pytriton's, the same 2.x line as
the pinned image): the manifest's restricted-API flags close exactly the control APIs, on HTTP and
gRPC, to all but the control key; and the manifest's startupProbe, run as the kubelet runs it,
passes only once the server serves a model or the repository holds none."""

from __future__ import annotations

import os
import secrets
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from controller.triton_admin import CONTROL_HEADER
from skewserve.sample_models import write_affine_model
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from tests.deploy.test_kubernetes import _base_resources, _by_id

KEY = secrets.token_hex(16)


def _container() -> dict[str, Any]:
    triton = _by_id(_base_resources())[("StatefulSet", "triton")]
    container: dict[str, Any] = triton["spec"]["template"]["spec"]["containers"][0]
    return container


def _manifest_flags() -> tuple[str, ...]:
    """The manifest's restricted-API flags, with the key Kubernetes would expand into them."""
    args = _container()["args"]
    flags = [a for a in args if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(flags) == 2
    return tuple(f.replace("$(SKEWSERVE_CONTROL_KEY)", KEY) for f in flags) + ("--strict-readiness=false",)


def _start(repo: Path, logs: Path, prepared: PreparedTriton) -> TritonServer:
    spec = TritonServerSpec(repository=repo, model_control_mode="explicit", extra_args=_manifest_flags())
    return TritonServer(spec, logs, prepared).start()


@pytest.fixture(scope="module")
def server(
    prepared_triton: PreparedTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    work = tmp_path_factory.mktemp("triton-pod")
    write_affine_model(work / "repo", "affine", scale=2.0)
    s = _start(work / "repo", work / "logs", prepared_triton)
    try:
        yield s
    finally:
        s.stop()


def _http(server: TritonServer, path: str, body: bytes | None = None, key: str | None = None) -> int:
    headers = {CONTROL_HEADER: key} if key else {}
    req = urllib.request.Request(server.http_url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _probe(server: TritonServer) -> int:
    """The startupProbe's exec command, verbatim, with the container's environment, the mounted
    ConfigMap's file read from where kustomize takes it (deploy/k8s/base), and no controller (the
    probe with one is tests/controller/test_server_readiness.py)."""
    mount = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}["probe"]
    base = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base"
    command = [a.replace(mount, str(base)) for a in _container()["startupProbe"]["exec"]["command"]]
    env = {**os.environ, "SKEWSERVE_PROBE_URL": server.http_url, "SKEWSERVE_CONTROL_KEY": KEY}
    env.pop("SKEWSERVE_CONTROLLER_URL", None)
    return subprocess.run(command, env=env, capture_output=True, timeout=60).returncode


CONTROL_HTTP = [
    ("/v2/repository/index", b"{}"),
    ("/v2/systemsharedmemory/status", None),
    ("/v2/cudasharedmemory/status", None),
    ("/v2/trace/setting", None),
    ("/v2/logging", None),
]
SERVING_HTTP = ["/v2/health/ready", "/v2", "/v2/models/stats"]


def test_the_control_apis_answer_only_the_control_key_on_http(server: TritonServer) -> None:
    for path, body in CONTROL_HTTP:
        assert _http(server, path, body) == 403, path
        assert _http(server, path, body, key="not-the-key") == 403, path
        assert _http(server, path, body, key=KEY) == 200, path
    for path in SERVING_HTTP:
        assert _http(server, path) == 200, path


def test_the_control_apis_answer_only_the_control_key_on_grpc(server: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    calls = {
        "repository": lambda h: client.get_model_repository_index(headers=h),
        "system shared memory": lambda h: client.get_system_shared_memory_status(headers=h),
        "cuda shared memory": lambda h: client.get_cuda_shared_memory_status(headers=h),
        "trace": lambda h: client.get_trace_settings(headers=h),
        "logging": lambda h: client.get_log_settings(headers=h),
    }
    try:
        for what, call in calls.items():
            with pytest.raises(InferenceServerException, match="restricted"):
                call(None)
                pytest.fail(f"{what} answered without the key")
            # Triton reads a gRPC restriction's key from metadata under this prefix
            call({f"triton-grpc-protocol-{CONTROL_HEADER}": KEY})  # answers
        assert client.is_server_ready() and client.get_inference_statistics() is not None
    finally:
        client.close()


def test_the_startup_probe_passes_once_a_model_is_served(server: TritonServer) -> None:
    """Started empty (explicit mode): not started while the repository holds a model nobody loaded;
    started once the controller's load is READY; and an unload brings it back to not started."""
    assert _probe(server) == 1
    assert _http(server, "/v2/repository/models/affine/load", b"{}", key=KEY) == 200
    assert _probe(server) == 0
    assert _http(server, "/v2/repository/models/affine/unload", b"{}", key=KEY) == 200
    assert _probe(server) == 1


def test_the_startup_probe_passes_on_an_empty_repository_and_fails_on_a_dead_server(
    prepared_triton: PreparedTriton, tmp_path: Path
) -> None:
    (tmp_path / "repo").mkdir()
    empty = _start(tmp_path / "repo", tmp_path / "logs", prepared_triton)
    try:
        assert _probe(empty) == 0  # a fresh cluster before the first publish still starts
    finally:
        empty.stop()
    assert _probe(empty) != 0
