"""Issue 24: NVIDIA's own client examples pass through the gateway wherever they pass directly.

Each example (tests/conformance/triton_client_examples, see README.md there) runs once against a
Triton and once through the gateway (HAProxy data plane, cache on for the models they call), with
only the URL changed. Every example that passes directly must pass through the gateway, except the
deliberate refusals, which must fail at once with the gateway's own error naming what is refused.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.conformance.triton_models import example_repo
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway, start_fleet, stop_fleet

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).parent / "triton_client_examples"
# Refused by design (README, "Refused by design"): the example and what its client is told.
REFUSED = {
    "simple_http_shm_client": "is not served by the gateway",
    "simple_grpc_shm_client": "Method not found: /inference.GRPCInferenceService/SystemSharedMemory",
    "simple_http_model_control": "is not served by the gateway",
    "simple_grpc_model_control": "Method not found: /inference.GRPCInferenceService/Repository",
    # Checks its answers, then registers system shared memory for a last round.
    "reuse_infer_objects_client": "Method not found: /inference.GRPCInferenceService/SystemSharedMemory",
}
# reuse_infer_objects over HTTP: the gateway's 404 for the shared-memory API.
REFUSED_HTTP = {"reuse_infer_objects_client": "is not served by the gateway"}


def protocol_of(name: str) -> str:
    return "http" if "_http_" in name else "grpc"


def _runs() -> list[tuple[str, list[str]]]:
    """(name, extra arguments) of every example run: reuse_infer_objects runs once per protocol."""
    runs = []
    for path in sorted(EXAMPLES.glob("*.py")):
        if path.stem == "reuse_infer_objects_client":
            runs += [(f"{path.stem}[http]", ["-i", "http"]), (f"{path.stem}[grpc]", ["-i", "grpc"])]
        elif "sequence" in path.stem:
            # Sequence examples running at once need their own correlation ids (the examples'
            # --offset is there for this).
            runs.append((path.stem, ["-o", str(10 * len(runs))]))
        else:
            runs.append((path.stem, []))
    return runs


def _address(name: str, extra: list[str], http: str, grpc: str) -> str:
    return http if (protocol_of(name) == "http" and "-i" not in extra) or "http" in extra else grpc


def _run(name: str, extra: list[str], url: str) -> tuple[bool, str]:
    script = EXAMPLES / f"{name.split('[')[0]}.py"
    try:
        done = subprocess.run(
            [sys.executable, str(script), "-u", url, *extra], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return False, "timed out after 120 s"
    return done.returncode == 0, (done.stdout + done.stderr)[-2000:]


@pytest.fixture(scope="module")
def example_fleet(
    tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    repo = example_repo(tmp_path_factory.mktemp("example_repo"))
    # The examples check the server's name: Triton's default, not the region-name ids of other tests.
    f = start_fleet(
        repo,
        {"us-east": 2},
        tmp_path_factory.mktemp("example_logs"),
        prepared_triton,
        extra_args=("--id=triton",),
    )
    yield f
    stop_fleet(f)


@pytest.fixture(scope="module")
def example_gw(example_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayUnderTest]:
    cfg = gateway_config(example_fleet, cache={"backend": "memory", "models": ["simple", "simple_string"]})
    g = launch_gateway(cfg, tmp_path_factory.mktemp("example_gw"))
    yield g
    g.stop()


def test_triton_client_examples_pass_through_the_gateway(example_fleet, example_gw) -> None:
    triton = example_fleet["us-east"][0]
    runs = _runs()

    def both(run: tuple[str, list[str]]) -> tuple[str, tuple[bool, str], tuple[bool, str]]:
        name, extra = run
        direct = _run(name, extra, _address(name, extra, triton.http_address, triton.grpc_address))
        via = _run(name, extra, _address(name, extra, example_gw.http, example_gw.grpc))
        return name, direct, via

    # Shared-memory examples name their regions alike: one at a time, after the others.
    alone = [run for run in runs if run[0].split("[")[0] in REFUSED]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(both, [run for run in runs if run not in alone]))
    results += [both(run) for run in alone]
    counts: dict[str, list[int]] = {"http": [0, 0, 0], "grpc": [0, 0, 0]}  # examples, direct, gateway
    failures = []
    for name, (direct_ok, direct_out), (via_ok, via_out) in results:
        row = counts["http" if "[http]" in name or ("_http_" in name and "[" not in name) else "grpc"]
        row[0] += 1
        row[1] += direct_ok
        row[2] += via_ok
        stem = name.split("[")[0]
        print(f"{name:48s} direct {'pass' if direct_ok else 'FAIL'}  gateway {'pass' if via_ok else 'FAIL'}")
        if stem in REFUSED:
            refusal = REFUSED_HTTP.get(stem, REFUSED[stem]) if "[http]" in name else REFUSED[stem]
            if via_ok or refusal not in via_out:
                failures.append(f"{name}: expected the refusal {refusal!r}, got: {via_out[-600:]}")
        elif direct_ok and not via_ok:
            failures.append(f"{name} passes directly but not through the gateway: {via_out[-1200:]}")
        elif not direct_ok:
            failures.append(f"{name} fails directly (the models here must serve it): {direct_out[-1200:]}")
    for protocol, (n, direct, via) in counts.items():
        print(f"{protocol}: {n} examples, {direct} pass directly, {via} through the gateway")
    assert not failures, "\n\n".join(failures)
