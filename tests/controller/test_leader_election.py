"""Issue 34, item 5: controller replicas elect one leader through a lease in the repository. The
lease rules on a real store with a moved clock, then two `skewserve controller` processes on a real
tritonserver: one leads (its /readyz is 200, the other's 503), the leader is SIGKILLed, the standby
takes over within the stated time, and it reconciles: a version published afterwards is rolled out
and served, and nothing the fleet served was unloaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from controller.leader import LeaderElection
from exporter.pipeline import export_artifact
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import KEY, controlled_server, loaded
from tests.waiting import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_leader_and_a_take_over_only_after_a_whole_lease_without_renewal(tmp_path: Path) -> None:
    store = DiskStateStore(tmp_path)
    clock = Clock()
    a = LeaderElection(store, "a", duration_s=15, clock=clock)
    b = LeaderElection(store, "b", duration_s=15, clock=clock)
    assert a.attempt() and not b.attempt()
    for _ in range(10):  # a renews every 5 s: b never takes over, however long
        clock.now += 5
        assert a.attempt() and not b.attempt()
        assert a.leading and not b.leading
    clock.now += 10.1  # a stopped renewing: it stops leading at 2/3 of the lease...
    assert not a.leading
    assert not b.attempt()  # ...and b waits a whole lease from when it last saw a renewal
    clock.now += 5
    assert b.attempt() and b.term == 2 and b.leading
    assert not a.attempt()  # the old leader comes back as a standby
    b.release()  # a clean stop hands over at once
    assert a.attempt() and a.term == 2 + 1


def test_of_two_replicas_racing_for_a_free_lease_one_wins(tmp_path: Path) -> None:
    store = DiskStateStore(tmp_path)
    read = store.read_record

    def racing(name: str) -> tuple[bytes | None, object]:
        seen = read(name)
        if racer.me == "b":  # a writes between b's read and b's write
            store.read_record = read  # type: ignore[method-assign]
            assert LeaderElection(store, "a", duration_s=15).attempt()
        return seen

    racer = LeaderElection(store, "b", duration_s=15)
    store.read_record = racing  # type: ignore[method-assign]
    assert not racer.attempt() and not racer.leading
    assert json.loads(store.read_record("leader-default")[0] or b"{}")["holder"] == "a"


def _controller(repo: Path, config: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "skewserve", "controller", "--config", str(config), "--repo", str(repo)]
    cmd += ["--interval", "0.5", "--listen", "127.0.0.1:0", "--leader-election", "--leader-lease", "3"]
    env = {**os.environ, "SKEWSERVE_CONTROL_KEY": KEY, "PYTHONUNBUFFERED": "1"}
    handle = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
    found: list[str] = []

    def listening() -> bool:
        match = re.search(r"controller API on (http://[0-9.]+:[0-9]+)", log.read_text(errors="replace"))
        if proc.poll() is not None:
            raise AssertionError(f"controller exited: {log.read_text()[-2000:]}")
        if match:
            found.append(match.group(1))
        return bool(match)

    wait_until(listening, 60, "the controller's API is listening")
    return proc, found[0]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return r.read().decode()


@pytest.mark.slow
def test_the_standby_takes_over_a_killed_leader_and_reconciles(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    server = controlled_server(repo, "s", tmp_path / "logs", prepared_triton)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        server.start()
        config = tmp_path / "gateway.yaml"
        config.write_text(
            json.dumps(
                {
                    "regions": [
                        {
                            "name": "r",
                            "servers": [
                                {"name": "s", "http": server.http_address, "grpc": server.grpc_address}
                            ],
                        }
                    ]
                }
            )
        )
        first, first_url = _controller(repo, config, tmp_path / "first.log")
        procs.append(first)
        wait_until(lambda: _ready(first_url), 60, "the first replica leads")
        wait_until(lambda: loaded(server) == {"lt": [1]}, 60, "the leader loaded lt")
        second, second_url = _controller(repo, config, tmp_path / "second.log")
        procs.append(second)
        wait_until(lambda: "leader 0.0" in _metrics(second_url), 30, "the second replica campaigned")
        for _ in range(5):  # one leader at a time: the second stays a standby while the first lives
            assert _ready(first_url) and not _ready(second_url)
            assert "skewserve_controller_leader 1.0" in _metrics(first_url)

        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        wait_until(lambda: _ready(second_url), 3 * 4 / 3 + 30, "the standby took over")
        assert loaded(server) == {"lt": [1]}  # nothing unloaded across the take-over

        export_artifact(small_artifact, repo, "other", tensorrt="off")  # the new leader reconciles
        wait_until(lambda: loaded(server) == {"lt": [1], "other": [1]}, 60, "the new leader loaded other")
        assert "now serves versions" not in (tmp_path / "second.log").read_text().split("leads (term 2)")[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        server.stop()
