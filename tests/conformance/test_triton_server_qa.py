"""Issue 24: Triton's own generate-extension tests (server repository, qa/L0_http at v2.51.0, the
version of the local tritonserver) pass through the gateway wherever they pass directly.

`triton_server_qa/` holds them unchanged (BSD-3, README.md here): `generate_endpoint_test.py`, its
`mock_llm` model (Python backend) and qa's `test_util.py`. The test file names its server as
`localhost:8000`; each run gets a copy with only that address changed, once to Triton and once to
the gateway, and every test that passes directly must pass through the gateway.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway, start_fleet, stop_fleet

pytestmark = pytest.mark.slow
QA = Path(__file__).parent / "triton_server_qa"
_RESULT = re.compile(r"^(test_\w+) \(.*\) \.\.\. (ok|FAIL|ERROR|skipped.*)$", re.MULTILINE)


@pytest.fixture(scope="module")
def qa_triton(
    tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    repo = tmp_path_factory.mktemp("qa_repo")
    shutil.copytree(QA / "generate_models", repo, dirs_exist_ok=True)
    f = start_fleet(
        repo, {"us-east": 1}, tmp_path_factory.mktemp("qa_logs"), prepared_triton, model_config_name=None
    )
    yield f
    stop_fleet(f)


@pytest.fixture(scope="module")
def qa_gw(qa_triton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayUnderTest]:
    g = launch_gateway(gateway_config(qa_triton, cache={"backend": "none"}), tmp_path_factory.mktemp("qa_gw"))
    yield g
    g.stop()


def run_generate_tests(address: str, workdir: Path) -> dict[str, str]:
    """Each test's outcome (ok, FAIL, ERROR) against the server at `address`."""
    workdir.mkdir()
    source = (QA / "generate_endpoint_test.py").read_text()
    (workdir / "generate_endpoint_test.py").write_text(source.replace("localhost:8000", address))
    shutil.copy(QA / "test_util.py", workdir / "test_util.py")
    done = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "generate_endpoint_test"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes = dict(_RESULT.findall(done.stderr))
    assert outcomes, f"no test results from the qa run:\n{done.stderr[-3000:]}"
    return outcomes


def test_tritons_generate_endpoint_tests_pass_through_the_gateway(qa_triton, qa_gw, tmp_path: Path) -> None:
    direct = run_generate_tests(qa_triton["us-east"][0].http_address, tmp_path / "direct")
    via = run_generate_tests(qa_gw.http, tmp_path / "gateway")
    for name in sorted(direct):
        print(f"{name:52s} direct {direct[name]:5s} gateway {via.get(name, 'missing')}")
    passed = sorted(n for n, r in direct.items() if r == "ok")
    print(
        f"generate (HTTP): {len(direct)} tests, {len(passed)} pass directly, "
        f"{sum(r == 'ok' for r in via.values())} through the gateway"
    )
    assert len(passed) >= len(direct) - 2, f"the local Triton fails most of its own tests: {direct}"
    assert [n for n in passed if via.get(n) != "ok"] == []
