"""Issue 34, item 2: serving means loaded. The Triton pods' startup probe (the real script the
manifests mount, deploy/k8s/base/triton-startup-probe.py) run against a real tritonserver and a
real controller: a server that serves one model while another wanted model cannot load is not
started (the old rule, "serves a model", said it was); once the broken version is mended and the
controller loaded it, it is. With no controller answering, the probe falls back to Triton alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from controller.api_auth import CallerTokens
from controller.config import ControllerConfig
from controller.fleet import FleetSpec
from controller.runner import ControllerThread
from exporter.pipeline import export_artifact
from gateway.config import RegionConfig, ServerConfig
from repository.disk_store import DiskStateStore
from repository.layout import VERSION_CONFIGS
from skewserve.ports import free_port
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import KEY, controlled_server, loaded
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
PROBE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "triton-startup-probe.py"
TOKEN = "triton-probe-token-0123456789"
BROKEN = ('backend: "python"', 'backend: "nope"')


def _local_configs(repo: Path, model: str) -> list[Path]:
    """The config a version loads under: the model-level copy and the version's own."""
    return [
        repo / model / "configs" / "local.pbtxt",
        repo / model / "1" / VERSION_CONFIGS / "configs" / "local.pbtxt",
    ]


def _probe(server: str, triton: str, controller: str, token_file: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "SKEWSERVE_PROBE_URL": triton,
        "SKEWSERVE_CONTROL_KEY": KEY,
        "SKEWSERVE_CONTROLLER_URL": controller,
        "SKEWSERVE_SERVER": server,
        "SKEWSERVE_CONTROLLER_TOKEN_FILE": str(token_file),
    }
    return subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=60)


def _ready_answer(url: str, server: str) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        f"{url}/v1/servers/ready?server={server}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as refused:
        return refused.code, json.load(refused)


def test_a_server_is_started_only_once_every_wanted_model_is_loaded(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    for model in ("good", "broken"):
        export_artifact(small_artifact, repo, model, tensorrt="off")
    for path in _local_configs(repo, "broken"):
        path.write_text(path.read_text().replace(*BROKEN))
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "triton").write_text(TOKEN)
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    thread = None
    try:
        server.start()
        triton = f"http://{server.http_address}"
        host = server.http_address.rsplit(":", 1)[0]
        nobody = f"http://127.0.0.1:{free_port()}"  # no controller listens there
        # Triton alone: nothing loaded, the repository holds models -> not started
        assert _probe(host, triton, nobody, tokens / "triton").returncode == 1

        fleet = FleetSpec(
            [
                RegionConfig(
                    name="r",
                    servers=[ServerConfig(name="s", http=server.http_address, grpc=server.grpc_address)],
                )
            ]
        )
        cfg = ControllerConfig(interval_s=0.2, retry_after_s=0.2, load_timeout_s=120)
        thread = ControllerThread(fleet, DiskStateStore(repo), KEY, cfg).start()
        url = f"http://127.0.0.1:{thread.serve_demand('127.0.0.1', 0, CallerTokens(tokens))}"
        wait_until(lambda: loaded(server) == {"good": [1]}, 120, "the controller loaded good")
        wait_until(
            lambda: _ready_answer(url, host)[1].get("missing") == {"broken": [1]},
            60,
            "a pass saw good loaded",
        )

        status, body = _ready_answer(url, host)
        assert (status, body["state"], body["missing"]) == (503, "loading", {"broken": [1]})
        assert body["wanted"] == {"broken": [1], "good": [1]}
        # the server serves a model, but not everything it should: not started
        probed = _probe(host, triton, url, tokens / "triton")
        assert probed.returncode == 1 and "is loading" in probed.stderr
        # the same pod seen by Triton alone would have counted as started
        assert _probe(host, triton, nobody, tokens / "triton").returncode == 0
        assert _ready_answer(url, "10.9.9.9")[1]["state"] == "unknown"
        assert _probe("10.9.9.9", triton, url, tokens / "triton").returncode == 1

        for path in _local_configs(repo, "broken"):  # mended: the controller's retry loads it
            path.write_text(path.read_text().replace(BROKEN[1], BROKEN[0]))
        wait_until(lambda: _ready_answer(url, host)[0] == 200, 120, "the controller loaded broken")
        assert loaded(server) == {"broken": [1], "good": [1]}
        assert _probe(host, triton, url, tokens / "triton").returncode == 0
        assert _probe("r/s", triton, url, tokens / "triton").returncode == 0  # by name as well

        # a wrong token gets no verdict: the probe falls back to Triton alone (which serves)
        (tmp_path / "wrong").write_text("not-the-token-0123456789")
        probed = _probe(host, triton, url, tmp_path / "wrong")
        assert probed.returncode == 0 and "401" in probed.stderr
    finally:
        if thread is not None:
            thread.stop()
        server.stop()
