"""The local tritonserver runtime against real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from skewserve.errors import ModelLoadError, PortInUse, TritonNotInstalled
from skewserve.ports import free_port
from skewserve.triton_dist import PreparedTriton, prepare_triton, server_environment
from skewserve.triton_process import (
    TritonFleet,
    TritonServer,
    TritonServerSpec,
    serves_metrics,
    start_servers,
    stop_servers,
)
from tests.fixtures_models import write_affine_model
from tests.waiting import wait_until

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def _infer_http(url: str) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("INPUT0", list(X.shape), "FP32")
    inp.set_data_from_numpy(X, binary_data=True)
    return client.infer("affine", [inp]).as_numpy("OUTPUT0")


def _infer_grpc(address: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(address)
    inp = grpcclient.InferInput("INPUT0", list(X.shape), "FP32")
    inp.set_data_from_numpy(X)
    return client.infer("affine", [inp]).as_numpy("OUTPUT0")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_prepared_copy_has_stub_and_never_touches_site_packages(prepared_triton: PreparedTriton) -> None:
    assert prepared_triton.binary.is_file()
    assert (prepared_triton.backend_directory / "python" / "triton_python_backend_stub").is_file()
    assert "site-packages" not in str(prepared_triton.root)
    assert prepare_triton().root == prepared_triton.root  # built once, reused


def test_missing_stub_names_python_version(prepared_triton: PreparedTriton) -> None:
    with pytest.raises(TritonNotInstalled, match=r"no Python backend stub for Python 2\.7 .*it has 3\.10"):
        prepare_triton(version="2.7")


def test_environment_puts_venv_first_and_libpython_on_loader_path() -> None:
    import sys
    import sysconfig

    env = server_environment({"PATH": "/usr/bin"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert sysconfig.get_config_var("LIBDIR") in env["LD_LIBRARY_PATH"].split(os.pathsep)


def test_serves_http_and_grpc_with_local_profile(
    affine_repo: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    spec = TritonServerSpec(repository=affine_repo, region="us-east", name="a")
    with TritonServer(spec, log_dir, prepared_triton) as server:
        np.testing.assert_array_equal(_infer_http(server.http_address), X * 2 + 1)
        np.testing.assert_array_equal(_infer_grpc(server.grpc_address), X * 2 + 1)
        assert server.log_path.read_text()  # log streamed to its file
        pid = server.pid
    assert pid is not None and not _alive(pid)


def test_two_regions_at_once_and_clean_stop(affine_repo: Path, log_dir: Path) -> None:
    fleet = TritonFleet.for_regions(affine_repo, ["us-east", "eu-west"], 1, log_dir)
    with fleet:
        assert sorted(fleet.by_region()) == ["eu-west", "us-east"]
        ports = {s.http_port for s in fleet.servers} | {s.grpc_port for s in fleet.servers}
        assert len(ports) == 4
        for s in fleet.servers:
            np.testing.assert_array_equal(_infer_grpc(s.grpc_address), X * 2 + 1)
        pids = [s.pid for s in fleet.servers]
    assert all(p is not None and not _alive(p) for p in pids)


def _status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as fields (empty once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return {}
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}


def _frozen(pid: int) -> bool:
    return _status(pid).get("State", "").startswith("T")


def _sigterm_pending(pid: int) -> bool:
    """The process exists and holds a SIGTERM it has not yet acted on (it is frozen)."""
    fields = _status(pid)
    if not fields:
        return False
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def test_a_fleet_is_signalled_at_once_then_each_server_exits_on_its_sigterm(
    affine_repo: Path, log_dir: Path
) -> None:
    # Both servers are frozen (SIGSTOP), so a SIGTERM stays queued and neither can exit: a stop that
    # waits on one server before signalling the next never has both signals queued at once.
    fleet = TritonFleet.for_regions(affine_repo, ["us-east", "eu-west"], 1, log_dir, stop_timeout_s=60)
    fleet.start()
    pids = [s.pid for s in fleet.servers if s.pid is not None]
    assert len(pids) == 2
    stopping = threading.Thread(target=fleet.stop)
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        # A SIGSTOP acts only once the process next runs: a SIGTERM sent before that (a loaded
        # machine) would be taken first, lower-numbered, and never be seen queued.
        wait_until(lambda: all(_frozen(p) for p in pids), what="both servers frozen")
        stopping.start()
        wait_until(lambda: all(_sigterm_pending(p) for p in pids), what="a SIGTERM queued for every server")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        if stopping.is_alive():
            stopping.join(90)
        fleet.stop()
    assert not any(_alive(p) for p in pids)
    # Each left on its SIGTERM (Triton's own shutdown), not on the SIGKILL after the bound.
    assert all("Signal (15) received" in s.log_text() for s in fleet.servers)


def test_failing_model_reports_tritons_reason(
    tmp_path: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    write_affine_model(repo, "broken", fail_reason="weights file is missing: w.bin")
    spec = TritonServerSpec(repository=repo, name="broken")
    server = TritonServer(spec, log_dir, prepared_triton)
    with pytest.raises(ModelLoadError, match="weights file is missing: w.bin"):
        server.start()
    assert not server.is_running()


def test_taken_port_is_refused_with_its_number(
    affine_repo: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        spec = TritonServerSpec(repository=affine_repo, http_port=port)
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is already in use"):
            TritonServer(spec, log_dir, prepared_triton).start()


def test_a_fleet_member_fixing_one_port_gets_free_ones_for_the_rest(
    affine_repo: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    """Started with others (start_servers, as fleets start), a spec that fixes only its HTTP port is
    served there, with free gRPC and metrics ports chosen for it, as a server started alone is."""
    http_port = free_port()
    fixed = TritonServer(
        TritonServerSpec(repository=affine_repo, name="fixed", http_port=http_port), log_dir, prepared_triton
    )
    free = TritonServer(TritonServerSpec(repository=affine_repo, name="free"), log_dir, prepared_triton)
    start_servers([fixed, free])
    try:
        assert fixed.http_port == http_port and 0 not in (fixed.grpc_port, fixed.metrics_port)
        np.testing.assert_array_equal(_infer_http(fixed.http_address), X * 2 + 1)
        np.testing.assert_array_equal(_infer_grpc(fixed.grpc_address), X * 2 + 1)
    finally:
        stop_servers([fixed, free])


def test_a_spec_fixing_only_its_metrics_port_keeps_it(
    affine_repo: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    """Scraped right after start(): Triton opens its metrics port tens of milliseconds after HTTP
    answers ready, and a CI run once caught start() returning inside that gap."""
    metrics_port = free_port()
    spec = TritonServerSpec(repository=affine_repo, name="metrics", metrics_port=metrics_port)
    with TritonServer(spec, log_dir, prepared_triton) as server:
        assert server.metrics_port == metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert b"nv_inference_count" in r.read()


def test_a_server_told_to_serve_no_metrics_starts_without_waiting_for_them(
    affine_repo: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    """start() waits for the metrics port too (Triton opens it after HTTP answers ready), except
    where Triton's own flags turn metrics off: there is nothing to wait for."""
    flags = ("--allow-metrics", "OFF")
    spec = TritonServerSpec(repository=affine_repo, name="quiet", extra_args=flags, startup_timeout_s=60)
    with TritonServer(spec, log_dir, prepared_triton) as server:
        np.testing.assert_array_equal(_infer_http(server.http_address), X * 2 + 1)
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(server.metrics_url, timeout=10)


def test_a_fleet_member_whose_fixed_port_is_taken_is_refused_and_none_left_running(
    affine_repo: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    free = TritonServer(TritonServerSpec(repository=affine_repo, name="free"), log_dir, prepared_triton)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        taken = TritonServer(
            TritonServerSpec(repository=affine_repo, name="taken", grpc_port=port), log_dir, prepared_triton
        )
        with pytest.raises(
            PortInUse, match=f"port {port} on 127.0.0.1 is already in use; choose another for local/taken"
        ):
            start_servers([free, taken])
    assert not free.is_running() and not taken.is_running()


def test_a_server_listed_twice_is_refused_before_any_starts(
    affine_repo: Path, log_dir: Path, prepared_triton: PreparedTriton
) -> None:
    server = TritonServer(TritonServerSpec(repository=affine_repo), log_dir, prepared_triton)
    try:
        with pytest.raises(ValueError, match="a server is listed twice; list each once"):
            start_servers([server, server])
        assert server.pid is None
    finally:
        server.stop()


def test_a_server_that_cannot_be_launched_leaves_no_open_log(
    affine_repo: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    broken = PreparedTriton(tmp_path / "no-triton-here")  # no binary to run
    server = TritonServer(TritonServerSpec(repository=affine_repo), tmp_path / "logs", broken)
    with pytest.raises(FileNotFoundError):
        start_servers([server])
    open_logs = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == str(server.log_path):
                open_logs.append(fd)
    assert open_logs == []


def test_missing_repository_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory; export a model first"):
        TritonServerSpec(repository=tmp_path / "nope")


def test_missing_pytriton_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from skewserve.triton_dist import locate_distribution

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        TritonNotInstalled, match=r"nvidia-pytriton package is not installed.*Run `make setup`"
    ):
        locate_distribution()


def test_missing_binary_names_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.machinery
    import importlib.util

    from skewserve.triton_dist import locate_distribution

    (tmp_path / "pytriton" / "tritonserver").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("pytriton", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "pytriton")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(
        TritonNotInstalled, match=r"tritonserver binary not found at .*pytriton/tritonserver/bin/tritonserver"
    ):
        locate_distribution()


@pytest.mark.parametrize(
    ("flags", "serves"),
    [
        ((), True),
        (("--allow-metrics=false",), False),
        (("--allow-metrics", "OFF"), False),
        (("--allow-metrics=0",), False),
        (("--allow-metrics=true", "--log-info=false"), True),
    ],
)
def test_metrics_are_waited_for_unless_tritons_flags_turn_them_off(
    flags: tuple[str, ...], serves: bool
) -> None:
    assert serves_metrics(flags) is serves
