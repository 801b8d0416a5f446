"""A version failing on one server, closed control APIs, a controller killed mid-rollout, and no
repository listing by anyone, on servers run as in deploy/ (tests/controller/conftest.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controller.reconcile import Controller
from exporter.pipeline import export_artifact
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, as_controlled, controlled_server, loaded
from tests.gateway.conftest import gateway_config, launch_gateway
from tests.gateway.steady_load import SteadyLoad
from tests.waiting import wait_until


@pytest.mark.slow
def test_a_version_failing_on_one_server_and_a_controller_killed_mid_rollout(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo, logs = tmp_path / "repo", tmp_path / "logs"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    export_artifact(small_artifact, repo, "other", tensorrt="off")
    # server "odd" reads a profile under which lt cannot load (as a GPU profile on a server without
    # one), while "other" loads there as everywhere
    local = (repo / "lt" / "configs" / "local.pbtxt").read_text()
    (repo / "lt" / "configs" / "odd.pbtxt").write_text(
        local.replace('backend: "python"', 'backend: "no_such_backend"')
    )
    (repo / "other" / "configs" / "odd.pbtxt").write_text(
        (repo / "other" / "configs" / "local.pbtxt").read_text()
    )
    store = DiskStateStore(repo)
    odd = controlled_server(repo, "odd", logs, prepared_triton, model_config_name="odd", log_verbose=1)
    good = controlled_server(repo, "good", logs, prepared_triton, log_verbose=1)
    gw = None
    try:
        odd.start()
        good.start()
        controller = Controller(store, as_controlled([odd, good]), KEY, CFG)
        report = controller.reconcile_once()
        assert [f.split(":")[0] for f in report.failures] == ["odd"], report.failures
        assert loaded(odd) == {"other": [1]} and loaded(good) == {"lt": [1], "other": [1]}
        state = store.current("lt")
        assert state is not None and list(state.load_failures) == [1]
        assert "no_such_backend" in state.load_failures[1]["odd"]
        with urllib.request.urlopen(f"{odd.http_url}/v2/health/ready", timeout=5) as r:
            assert r.status == 200  # the server keeps serving its other models
        gw = launch_gateway(
            gateway_config({"r": [odd, good]}, home="r", cache={"models": []}), tmp_path / "gw"
        )
        wait_until(lambda: gw.server("good")["models"].get("lt"), 30, "gateway sees lt on good")
        assert "lt" not in gw.server("odd")["models"]
        load = SteadyLoad(gw.http).start()  # lt: routed to "good" only

        # Triton's model control through any public port, without the key: refused
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{good.http_url}/v2/repository/models/lt/unload", b"{}", method="POST"
                )
            )
        assert refused.value.code == 403 and "restricted" in refused.value.read().decode()
        with pytest.raises(InferenceServerException, match="restricted"):
            grpcclient.InferenceServerClient(good.grpc_address).unload_model("lt")
        with pytest.raises(InferenceServerException, match="restricted"):
            httpclient.InferenceServerClient(good.http_address).get_model_repository_index()
        # and the APIs that reach into the server's memory and files, as deploy/ closes them
        for closed in (
            lambda c: c.get_trace_settings(),
            lambda c: c.get_log_settings(),
            lambda c: c.get_system_shared_memory_status(),
        ):
            for client in (
                httpclient.InferenceServerClient(good.http_address),
                grpcclient.InferenceServerClient(good.grpc_address),
            ):
                with pytest.raises(InferenceServerException, match="restricted"):
                    closed(client)
        for gateway_call in (
            lambda: httpclient.InferenceServerClient(gw.http).unload_model("lt"),
            lambda: grpcclient.InferenceServerClient(gw.grpc).unload_model("lt"),
        ):
            with pytest.raises(InferenceServerException):
                gateway_call()
        assert loaded(good) == {"lt": [1], "other": [1]}

        # a rollout command SIGKILLed mid-canary; a controller started afterwards converges
        export_artifact(small_artifact, repo, "other", tensorrt="off")
        cmd = [
            sys.executable,
            "-m",
            "skewserve",
            "rollout",
            "other",
            "--version",
            "2",
            "--repo",
            str(repo),
        ]
        cmd += ["--servers", f"{good.http_url}"]
        proc = subprocess.Popen(cmd, env={**_env(), "SKEWSERVE_CONTROL_KEY": KEY})
        try:

            def canary_claimed() -> bool:
                st = store.current("other")
                return st is not None and st.canary is not None and bool(st.canary.checking)

            wait_until(canary_claimed, 120, "the rollout command claimed its canary")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        restarted = Controller(store, as_controlled([odd, good]), KEY, CFG)
        for _ in range(50):
            restarted.reconcile_once()
            st = store.current("other")
            assert st is not None
            if (
                st.canary is None
                and loaded(good).get("other") == st.served
                and loaded(odd).get("other") == st.served
            ):
                break
        assert st.served == [2] and st.versions[2].state == "promoted"
        assert loaded(good)["other"] == [2] and loaded(odd)["other"] == [2]
        load.stop()
        assert load.failed == [] and load.ok > 0

        # neither the gateway's probes (every 0.2 s here) nor the controller's passes list the
        # repository: the one index request on "good" is this test's own, refused above
        for server, own in ((odd, 0), (good, 1)):
            index_requests = [
                line
                for line in server.log_text().splitlines()
                if "HTTP request: 2 /v2/repository/index" in line or "Process for RepositoryIndex" in line
            ]
            assert len(index_requests) == own, index_requests[:3]
            assert "Process for ModelStatistics" in server.log_text()  # the probes did run
    finally:
        if gw is not None:
            gw.stop()
        odd.stop()
        good.stop()


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
