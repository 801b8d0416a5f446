"""`skewserve triton up` and `skewserve up` switch on Triton's own response cache (real processes)."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.monitoring.stack import write_monitoring_repo
from tests.process_helpers import cli_process, read_until
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_monitoring_repo(tmp_path_factory.mktemp("cache_repo"))


def _infer_three_times_and_read_cache_hits(http_url: str) -> int:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [7.0] * 4}]}
    ).encode()
    for _ in range(3):
        req = urllib.request.Request(
            f"{http_url}/v2/models/tcached/infer", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["outputs"][0]["data"] == [15.0] * 4
    # Triton books a request's statistics just after sending its answer: read once all three are in
    # (`success` counts cache hits too)
    wait_until(lambda: int(_inference_stats(http_url)["success"]["count"]) >= 3, 30, "three answers booked")
    return int(_inference_stats(http_url)["cache_hit"]["count"])


def _inference_stats(http_url: str) -> dict[str, dict[str, int]]:
    with urllib.request.urlopen(f"{http_url}/v2/models/tcached/stats", timeout=10) as r:
        stats: dict[str, dict[str, int]] = json.loads(r.read())["model_stats"][0]["inference_stats"]
    return stats


def test_triton_up_response_cache_flag_serves_repeats_from_triton_cache(repo: Path, tmp_path: Path) -> None:
    with cli_process(
        "triton", "up", "--repo", str(repo), "--response-cache-mb", "4", "--log-dir", str(tmp_path / "logs")
    ) as proc:
        text = read_until(proc, "press Ctrl-C")
        urls = re.findall(r"(http://127\.0\.0\.1:\d+)(?!\d|/)", text)
        assert len(urls) == 1, text
        assert _infer_three_times_and_read_cache_hits(urls[0]) == 2
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 0


def test_triton_up_without_the_flag_has_no_cache_hits(repo: Path, tmp_path: Path) -> None:
    with cli_process("triton", "up", "--repo", str(repo), "--log-dir", str(tmp_path / "logs")) as proc:
        text = read_until(proc, "press Ctrl-C")
        urls = re.findall(r"(http://127\.0\.0\.1:\d+)(?!\d|/)", text)
        assert len(urls) == 1, text
        assert _infer_three_times_and_read_cache_hits(urls[0]) == 0


def test_up_response_cache_flag_reaches_every_triton_server(repo: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "repository": str(repo),
                "regions": {"us-east": 1, "eu-west": 1},
                "gateway": {"listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0}},
            }
        )
    )
    with cli_process(
        "up", "--config", str(cfg), "--response-cache-mb", "4", "--log-dir", str(tmp_path / "logs")
    ) as proc:
        text = read_until(proc, "press Ctrl-C")
        triton = re.findall(r"triton\s+│\s+\S+\s+│\s+\S+\s+│\s+(http://127\.0\.0\.1:\d+)", text)
        assert len(triton) == 2, text  # one server in each region, every one checked
        assert [_infer_three_times_and_read_cache_hits(url) for url in triton] == [2, 2]


def test_stack_config_response_cache_reaches_every_server_spec(repo: Path, tmp_path: Path) -> None:
    from skewserve.stack import LocalStack, load_stack_config

    cfg = tmp_path / "stack.yaml"
    cfg.write_text(yaml.safe_dump({"repository": str(repo), "regions": {"a": 2}, "response_cache_mb": 3}))
    stack = LocalStack(load_stack_config(cfg), tmp_path / "logs")
    assert [s.spec.cache_config for s in stack.fleet.servers] == [("local,size=3145728",)] * 2
