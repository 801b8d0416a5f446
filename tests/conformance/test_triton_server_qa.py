"""Issue 24: Triton's own protocol tests (server repository, qa/ at v2.51.0, the version of the
local tritonserver) pass through the gateway wherever they pass directly.

`triton_server_qa/` holds them unchanged (BSD-3, README.md here): qa/L0_http's
`generate_endpoint_test.py` with its `mock_llm` model, qa/L0_parameters' `parameters_test.py` (HTTP,
gRPC, their async clients, a gRPC stream and an ensemble, each with request parameters and
forwarded headers) with its `parameter` model and ensemble, and qa's `test_util.py`. The test files
name their server as `localhost:8000` / `localhost:8001`; each run gets a copy with only those
addresses changed, once to Triton and once to the gateway, and every test that passes directly must
pass through the gateway.
"""

from __future__ import annotations

import os
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
_START = re.compile(r"^(test_\w+) \([^)\n]*\) \.\.\. ", re.MULTILINE)
_OUTCOME = re.compile(r"(?:^|\s)(ok|FAIL|ERROR|skipped[^\n]*)$", re.MULTILINE)
_SUMMARY = re.compile(r"^(?:={10,}|-{10,})", re.MULTILINE)


def unittest_outcomes(text: str) -> dict[str, str]:
    """Each test's outcome in `unittest -v` output. Other output can come between a test's name and
    its outcome (IsolatedAsyncioTestCase runs in asyncio debug mode, whose "Executing <Task ...>
    took 0.101 seconds" lines land there on a loaded machine): the first outcome after the name."""
    starts = list(_START.finditer(text))
    out = {}
    for i, start in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        chunk = _SUMMARY.split(text[start.end() : end], maxsplit=1)[0]
        found = _OUTCOME.search(chunk)
        if found is not None:
            out[start.group(1)] = found.group(1)
    return out


# qa/L0_parameters/test.sh: one server per mode, with these header-forward flags (TEST_HEADER=mode).
PARAMETER_MODES = {
    "test_params": (),
    "test_headers": (
        "--grpc-header-forward-pattern",
        "my_header.*",
        "--http-header-forward-pattern",
        "my_header.*",
    ),
    "test_header_forward_pattern_case_insensitive": (
        "--grpc-header-forward-pattern",
        "MY_HEADER.*",
        "--http-header-forward-pattern",
        "MY_HEADER.*",
    ),
    "test_grpc_header_forward_pattern_case_sensitive": ("--grpc-header-forward-pattern", "(?-i)MY_HEADER.*"),
}
# The C++ `identity` backend the ensemble's first step uses is not in this tritonserver: the same
# model on the Python backend.
IDENTITY_CONFIG = """
name: "identity"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
IDENTITY_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""


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


def run_qa_tests(
    module: str, http: str, workdir: Path, grpc: str = "", env: dict[str, str] | None = None
) -> dict[str, str]:
    """Each test's outcome (ok, FAIL, ERROR) of qa's `module` against the server at these addresses."""
    workdir.mkdir()
    source = (QA / f"{module}.py").read_text()
    source = source.replace("localhost:8000", http)
    if grpc:
        source = source.replace("localhost:8001", grpc)
    (workdir / f"{module}.py").write_text(source)
    shutil.copy(QA / "test_util.py", workdir / "test_util.py")
    done = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", module],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    outcomes = unittest_outcomes(done.stderr)
    (workdir / "unittest.log").write_text(done.stderr)
    assert outcomes, f"no test results from the qa run:\n{done.stderr[-3000:]}"
    return outcomes


def run_generate_tests(address: str, workdir: Path) -> dict[str, str]:
    return run_qa_tests("generate_endpoint_test", address, workdir)


# Every test of qa's two files, and each passes directly against this tritonserver (2.51, the
# nvidia-pytriton build): Triton's own results are asserted exactly, so a change in them is a
# failure here rather than a test silently dropped from the comparison.
GENERATE_TESTS = frozenset(
    {
        "test_0_dimension_output", "test_close_connection_during_streaming", "test_complex_schema",
        "test_duplicate_inputs", "test_generate", "test_generate_stream", "test_generate_stream_response_error",
        "test_generate_with_all_inputs", "test_invalid_input_types", "test_many_response", "test_missing_inputs",
        "test_one_response", "test_parameters", "test_race_condition", "test_request_id", "test_streaming",
        "test_zero_response",
    }
)  # fmt: skip
PARAMETER_TESTS = frozenset(
    {
        "test_async_grpc_parameter", "test_async_http_parameter", "test_ensemble_parameter_forwarding",
        "test_grpc_async_parameter", "test_grpc_parameter", "test_grpc_stream_parameter",
        "test_http_async_parameter", "test_http_parameter",
    }
)  # fmt: skip


def _compare(
    title: str, direct: dict[str, str], via: dict[str, str], everything: frozenset[str]
) -> list[str]:
    """Print the outcomes side by side; the tests that pass directly but not through the gateway.
    Directly, exactly `everything` runs and passes."""
    for name in sorted(direct):
        print(f"{name:52s} direct {direct[name]:5s} gateway {via.get(name, 'missing')}")
    passed = sorted(n for n, r in direct.items() if r == "ok")
    print(
        f"{title}: {len(direct)} tests, {len(passed)} pass directly, {sum(r == 'ok' for r in via.values())} through the gateway"
    )
    assert direct == dict.fromkeys(everything, "ok"), f"Triton's own results changed: {direct}"
    assert set(via) == everything, (
        f"tests missing or added through the gateway: {sorted(set(via) ^ everything)}"
    )
    return [n for n in passed if via.get(n) != "ok"]


def test_tritons_generate_endpoint_tests_pass_through_the_gateway(qa_triton, qa_gw, tmp_path: Path) -> None:
    direct = run_generate_tests(qa_triton["us-east"][0].http_address, tmp_path / "direct")
    via = run_generate_tests(qa_gw.http, tmp_path / "gateway")
    assert _compare("generate (HTTP)", direct, via, GENERATE_TESTS) == []


@pytest.fixture(scope="module")
def parameters_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("parameters_repo")
    shutil.copytree(QA / "parameters_models", repo, dirs_exist_ok=True)
    (repo / "ensemble" / "1").mkdir()
    (repo / "identity" / "1").mkdir(parents=True)
    (repo / "identity" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    (repo / "identity" / "1" / "model.py").write_text(IDENTITY_PY)
    return repo


# On the HAProxy data plane a gRPC metadata value loses trailing whitespace: HTTP/2 forbids it
# (RFC 9113 8.2.1: a field value must not end in whitespace) and HAProxy trims it, where grpc-core
# (Triton's own server, and the grpcio plane) passes it on. qa's `my_header_3` ends in a space, so
# these tests see it without: they must fail for that reason and no other.
TRAILING_SPACE = (
    "'This is a \"quoted\" string with a backslash\\\\'",
    "'This is a \"quoted\" string with a backslash\\\\ '",
)
GRPC_WITH_HEADERS = {
    "test_grpc_parameter",
    "test_async_grpc_parameter",
    "test_grpc_async_parameter",
    "test_grpc_stream_parameter",
}
# The grpcio plane too in one mode with headers: there the whitespace reaches the model as sent.
PLANES = {mode: ("haproxy", "grpcio") if mode == "test_headers" else ("haproxy",) for mode in PARAMETER_MODES}


@pytest.mark.parametrize("mode", sorted(PARAMETER_MODES))
def test_tritons_parameter_and_header_tests_pass_through_the_gateway(
    parameters_repo: Path, prepared_triton: PreparedTriton, tmp_path: Path, mode: str
) -> None:
    """qa/L0_parameters, one of its four server modes: Triton started with that mode's
    header-forward flags, the gateway forwarding every header (Triton filters by its own flags)."""
    fleet = start_fleet(
        parameters_repo,
        {"us-east": 1},
        tmp_path / "logs",
        prepared_triton,
        model_config_name=None,
        extra_args=PARAMETER_MODES[mode],
    )
    gateways: dict[str, GatewayUnderTest] = {}
    try:
        for plane in PLANES[mode]:
            cfg = gateway_config(
                fleet,
                cache={"backend": "none"},
                routing={"header_forward_pattern": ".*"},
                listen={"grpc_data_plane": plane},
            )
            gateways[plane] = launch_gateway(cfg, tmp_path / f"gateway_{plane}_logs")
        triton = fleet["us-east"][0]
        env = {"TEST_HEADER": mode}
        runs = {"direct": (triton.http_address, triton.grpc_address)}
        runs.update({plane: (g.http, g.grpc) for plane, g in gateways.items()})
        # One after another, as qa runs them. (Run at once, the ensemble test failed once on the
        # HAProxy-plane run while passing directly: noticed, not yet investigated.)
        results = {
            name: run_qa_tests("parameters_test", http, tmp_path / name, grpc, env)
            for name, (http, grpc) in runs.items()
        }
    finally:
        for g in gateways.values():
            g.stop()
        stop_fleet(fleet)
    for plane in PLANES[mode]:
        failing = set(
            _compare(
                f"parameters, {mode}, {plane} plane (HTTP and gRPC)",
                results["direct"],
                results[plane],
                PARAMETER_TESTS,
            )
        )
        if plane == "haproxy" and mode in ("test_headers", "test_header_forward_pattern_case_insensitive"):
            # Exactly the gRPC tests with headers, and for the trailing space alone. (The grpc.aio
            # one, test_async_grpc_parameter, was once left out of this comparison as unstable; it
            # is asserted like the others: a flake shows here by name.)
            assert failing == GRPC_WITH_HEADERS, failing
            log = (tmp_path / plane / "unittest.log").read_text()
            assert log.count("AssertionError") == len(failing)
            assert log.count(TRAILING_SPACE[0]) == log.count(TRAILING_SPACE[1]) == len(failing), log
        else:
            assert failing == set(), (plane, failing)


def test_outcomes_are_read_past_interleaved_output() -> None:
    text = (
        "test_a (m.T.test_a) ... ok\n"
        "test_b (m.T.test_b) ... Executing <Task finished coro=<T.test_b() done> took 0.101 seconds\n"
        "ok\n"
        "test_c (m.T.test_c) ... FAIL\n"
        "test_d (m.T.test_d) ... skipped 'no GPU'\n"
        "\n======================================================================\nFAIL: test_c ok\n"
    )
    assert unittest_outcomes(text) == {
        "test_a": "ok",
        "test_b": "ok",
        "test_c": "FAIL",
        "test_d": "skipped 'no GPU'",
    }
