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
from typing import Any

import pytest

from controller.leader import LeaderElection
from exporter.pipeline import export_artifact
from repository.disk_store import DiskStateStore
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import start_servers, stop_servers
from tests.controller.conftest import KEY, controlled_server, loaded, two_versions
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


def _controller(repo: Path, config: Path, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "skewserve", "controller", "--config", str(config), "--repo", str(repo)]
    cmd += [
        "--interval",
        "0.5",
        "--listen",
        "127.0.0.1:0",
        "--leader-election",
        "--leader-lease",
        "3",
        *extra,
    ]
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


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every controller still running (a clean stop releases its lease), SIGKILL a stuck one."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


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
        _stop(procs)
        server.stop()


def _fleet_config(path: Path, servers: list[Any]) -> Path:
    entries = [{"name": s.spec.name, "http": s.http_address, "grpc": s.grpc_address} for s in servers]
    path.write_text(json.dumps({"regions": [{"name": "r", "servers": entries}]}))
    return path


@pytest.mark.slow
def test_a_leader_killed_mid_canary_hands_it_over_and_the_canary_finishes(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    """The leader is SIGKILLed while it holds the canary's lease to check a server: the standby takes
    over, waits out that lease (the check it interrupted is not trusted), checks what is left and
    promotes; the served version stays loaded on every server throughout, nothing is unloaded."""
    repo = tmp_path / "repo"
    store = two_versions(small_artifact, repo)
    servers = [controlled_server(repo, name, tmp_path / "logs", prepared_triton) for name in ("s1", "s2")]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        start_servers(servers)
        config = _fleet_config(tmp_path / "gateway.yaml", servers)
        first, first_url = _controller(repo, config, tmp_path / "first.log")
        procs.append(first)
        wait_until(lambda: _ready(first_url), 60, "the first replica leads")
        wait_until(lambda: all(loaded(s) == {"lt": [1]} for s in servers), 60, "the leader loaded lt")
        second, second_url = _controller(repo, config, tmp_path / "second.log")
        procs.append(second)
        wait_until(lambda: "leader 0.0" in _metrics(second_url), 30, "the second replica campaigned")

        store.update("lt", lambda s: s.start_canary(2))

        def checking() -> bool:
            state = store.current("lt")
            assert state is not None and state.canary is not None, "the canary finished before the kill"
            return bool(state.canary.checking)

        wait_until(checking, 60, "the leader checks version 2 on a server", interval=0.002)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        wait_until(lambda: _ready(second_url), 3 * 4 / 3 + 30, "the standby took over")

        def promoted() -> bool:
            for server in servers:  # every server answers with lt throughout the hand-over
                assert "lt" in loaded(server), f"{server.spec.name} lost lt mid-canary"
            state = store.current("lt")
            return state is not None and state.canary is None and state.served == [2]

        wait_until(promoted, 120, "the new leader resumed the canary and promoted version 2")
        wait_until(lambda: all(loaded(s) == {"lt": [2]} for s in servers), 60, "every server serves 2")
        logs = (tmp_path / "first.log").read_text() + (tmp_path / "second.log").read_text()
        assert "unloaded" not in logs and "failed" not in logs.split("leads (term 2)")[-1]
    finally:
        _stop(procs)
        stop_servers(servers)


def test_a_leader_whose_renewals_stall_reports_standby_at_once_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by `make chaos`: a leader whose renewals hang on storage stops leading by its own clock
    at 2/3 of the lease, but its gauge said 1 until its next attempt returned, so two replicas
    reported leading at once (after the other took over); and the change was never logged."""
    from controller.fleet import FleetSpec
    from controller.runner import ControllerThread
    from gateway.config import RegionConfig, ServerConfig

    clock = Clock()
    fleet = FleetSpec(
        [RegionConfig(name="r", servers=[ServerConfig(name="s", http="127.0.0.1:9", grpc="127.0.0.1:9")])]
    )
    thread = ControllerThread(fleet, DiskStateStore(tmp_path), KEY, leader_election=True)
    assert thread.election is not None
    thread.election.clock = clock
    gauge = "skewserve_controller_leader 1.0"

    async def campaign() -> None:
        await thread._campaign_once()

    import asyncio

    with caplog.at_level("INFO", logger="controller.runner"):
        asyncio.run(campaign())
        assert thread.leading and gauge in thread.metrics.exposition()[0].decode()
        clock.now += thread.election.duration_s * 2 / 3 + 0.1  # no renewal came back in time
        assert not thread.leading
        assert "skewserve_controller_leader 0.0" in thread.metrics.exposition()[0].decode()
        thread.election.store = None  # type: ignore[assignment]  # the next attempt cannot read
        asyncio.run(campaign())
    said = [r.getMessage() for r in caplog.records]
    assert any(m.endswith("is the leader") for m in said) and any(m.endswith("is a standby") for m in said)


def _gate_loads(repo: Path, models: list[str], gate: Path) -> None:
    """Each model's load, in Triton's Python stub, leaves `<gate>.<model>.waiting` and waits for `gate`."""
    for model in models:
        code = repo / model / "1" / "model.py"
        code.write_text(
            code.read_text()
            + "\n\nimport pathlib as _pathlib, time as _time\n"
            + f"_pathlib.Path({str(gate)!r} + '.{model}.waiting').touch()\n"
            + f"while not _pathlib.Path({str(gate)!r}).exists():\n    _time.sleep(0.01)\n"
        )


@pytest.mark.slow
def test_a_leader_killed_mid_placement_leaves_each_model_loaded_once_and_nothing_unloaded(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    """Placement gives each of four models one copy; the leader is SIGKILLed while a server is
    loading one. The standby takes over, rebuilds placement from what the servers hold, and finishes
    it: each model ends on exactly one server, no server loaded a model twice, none unloaded one."""
    repo = tmp_path / "repo"
    models = ["m0", "m1", "m2", "m3"]
    for model in models:
        export_artifact(small_artifact, repo, model, tensorrt="off")
    gate = tmp_path / "loads-may-finish"
    _gate_loads(repo, models, gate)
    servers = [controlled_server(repo, name, tmp_path / "logs", prepared_triton) for name in ("s1", "s2")]
    placement = tmp_path / "placement.yaml"
    placement.write_text(json.dumps({"server_capacity_bytes": 1 << 34}))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        start_servers(servers)
        config = _fleet_config(tmp_path / "gateway.yaml", servers)
        for name in ("a", "b"):  # both campaign at once: the winner starts placing at its first pass
            procs.append(
                _controller(repo, config, tmp_path / f"{name}.log", "--placement", str(placement))[0]
            )
        # A load in flight is held open by its model (_gate_loads), so the kill lands mid-placement
        # however slowly this process is scheduled: polling Triton's log for a load's start raced
        # with the leader on a loaded machine, which sometimes saw all four loads through first.
        wait_until(
            lambda: any(gate.parent.glob(f"{gate.name}.*.waiting")), 120, "a server loads a placed model"
        )
        logs = {p: (tmp_path / f"{n}.log") for p, n in zip(procs, ("a", "b"), strict=True)}
        leader = next(p for p, log in logs.items() if "leads (term 1)" in log.read_text())
        leader.send_signal(signal.SIGKILL)
        leader.wait(timeout=30)
        seen_through = logs[leader].read_text().count(" now serves versions ")
        assert seen_through < len(models), "the leader saw its placement through before the kill"
        gate.touch()
        # The loads under way finish in Triton without the leader: placement is complete only
        # once the standby has taken over and rebuilt it from what the servers hold.
        standby = next(log for p, log in logs.items() if p is not leader)
        wait_until(lambda: "leads (term 2)" in standby.read_text(), 120, "the standby takes over")

        def placed() -> bool:
            held = [loaded(s) for s in servers]
            return sorted(m for h in held for m in h) == models

        wait_until(placed, 120, "the new leader finished placement")
        for server in servers:  # every load once, no unload, on either server
            log = server.log_text()
            for model in models:
                assert log.count(f"successfully loaded '{model}'") <= 1, (server.spec.name, model)
            assert "successfully unloaded" not in log, server.spec.name
        assert all(len(loaded(s)) >= 1 for s in servers)  # the copies are spread, not stacked
    finally:
        gate.touch()  # a load still held would delay its server's stop to Triton's exit timeout
        _stop(procs)
        stop_servers(servers)
