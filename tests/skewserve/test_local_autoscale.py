"""`skewserve up --autoscale` on one machine: real Triton servers added and removed one at a time.

The load is a number of clients, each always holding one request to `slow` (a model that sleeps)
in flight through the gateway, so the in-flight signal is set by the test, not by how fast this
machine happens to be: 6 clients (1 -> 2 -> 3 servers), then 2 clients (3 -> 2 while they keep
sending), then none (2 -> 1). The controller reads each Triton's /metrics; the gateway learns of
servers through DNS discovery (a loopback DNS server). The locust ramp-and-spike run behind the
README's figure is `benchmarks/autoscale_local.py`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skewserve.autoscale import AutoscalePolicy, recommend
from skewserve.local_autoscale import RegionAutoscaler
from skewserve.loopback_dns import LoopbackDns
from skewserve.stack import LocalStack, StackConfig
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.gateway.test_hostile_health import BOOM_BODY, SLOW_PY, hostile_repo, write_python_model
from tests.waiting import wait_until


class HeldClients:
    """Client threads, each with one request to `slow` in flight at a time; every failure is kept."""

    def __init__(self, http: str) -> None:
        self.url = f"http://{http}/v2/models/slow/infer"
        self.lock = threading.Lock()
        self.ok = 0
        self.failures: list[str] = []
        self.running: list[tuple[threading.Thread, threading.Event]] = []

    def _client(self, stop: threading.Event) -> None:
        while not stop.is_set():
            req = urllib.request.Request(
                self.url, data=BOOM_BODY, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    if json.loads(r.read())["outputs"][0]["data"] != [1.0, 2.0, 3.0, 4.0]:
                        raise ValueError("wrong answer")
                with self.lock:
                    self.ok += 1
            except Exception as exc:
                # what the gateway said and when: a failure must be traceable to the scaling step
                said = exc.read()[:300] if isinstance(exc, urllib.error.HTTPError) else b""
                with self.lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {exc!r} {said!r}")

    def resize(self, n: int) -> None:
        while len(self.running) > n:
            thread, stop = self.running.pop()
            stop.set()
            thread.join(60)
        while len(self.running) < n:
            stop = threading.Event()
            thread = threading.Thread(target=self._client, args=(stop,), daemon=True)
            thread.start()
            self.running.append((thread, stop))


def _steps(counts: list[int]) -> list[int]:
    return [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]]


@pytest.mark.slow
def test_servers_go_one_at_a_time_from_one_to_three_and_back_with_zero_failures(
    gateway_repo: Path, tmp_path: Path
) -> None:
    policy = AutoscalePolicy(
        signal="inflight",
        target=1.2,
        min_servers=1,
        max_servers=3,
        max_step_up=1,
        max_step_down=1,
        scale_down_window_s=8,
        window_s=2,
        interval_s=0.5,
    )
    cfg = StackConfig(
        repository=hostile_repo(gateway_repo, tmp_path / "repo", slow_s=0.2),
        regions={"local": 1},
        autoscale=policy,
        gateway={
            "home_region": "local",
            "listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0},
            "cache": {"backend": "none"},
            "health": {"interval_s": 0.2},
        },
    )
    with LocalStack(cfg, tmp_path / "stack") as stack:
        scaler = stack.autoscalers[0]
        clients = HeldClients(stack.gateway_http)
        try:
            clients.resize(6)
            wait_until(lambda: len(scaler.servers) == 3, 180, "3 servers under 6 clients")
            clients.resize(2)
            wait_until(lambda: len(scaler.servers) == 2, 120, "a server removed while 2 clients still send")
            under_load = clients.ok
            wait_until(lambda: clients.ok >= under_load + 10, 60, "the 2 clients served by 2 servers")
            stopped = time.time()
            clients.resize(0)
            wait_until(lambda: scaler.timeline[-1].servers == 1, 120, "back to one server after the load")
        finally:
            clients.resize(0)
        timeline = list(scaler.timeline)
    assert clients.failures == [] and clients.ok > 50, clients.failures[:3]
    counts = [p.servers for p in timeline]
    assert _steps(counts) == [1, 2, 3, 2, 1], _steps(counts)
    # the decision 3 -> 2 came while clients were sending, 2 -> 1 only after they stopped
    assert next(p for p in timeline if p.servers == 3 and p.desired == 2).wall < stopped
    assert next(p for p in timeline if p.servers == 2 and p.desired == 1).wall > stopped
    for p in (p for p in timeline if p.desired > p.servers):  # added only above target + tolerance
        assert p.signal > policy.target * (1 + policy.tolerance)
    for p in (p for p in timeline if p.desired < p.servers):  # removed only after the cool-down
        higher = [q for q in timeline if q.t < p.t and recommend(policy, q.servers, q.signal) > p.desired]
        assert higher and p.t - higher[-1].t > policy.scale_down_window_s


def test_up_autoscale_flag_serves_through_discovered_servers_and_stops_them(
    affine_repo: Path, tmp_path: Path
) -> None:
    import re
    import urllib.request

    import yaml

    from tests.process_helpers import cli_process, read_until

    cfg = tmp_path / "stack.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "repository": str(affine_repo),
                "model_control_mode": "none",
                "regions": {"local": 1},
                "gateway": {"listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0}},
            }
        )
    )
    with cli_process("up", "--config", str(cfg), "--autoscale", "--log-dir", str(tmp_path / "logs")) as proc:
        text = read_until(proc, "press Ctrl-C")
        assert re.search(r"autoscaling local: 1-4 servers on inflight \(target 2, cool-down 60s\)", text), (
            text
        )
        gw = re.search(r"gateway\s+│\s+local \(home\)\s+│\s+gateway\s+│\s+(http://[\d.]+:\d+)", text)
        assert gw, text
        pids = [int(p) for p in re.findall(r"triton\s+│.*│\s+(\d+)\s+│", text)]
        assert len(pids) == 1, text
        body = json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
        ).encode()
        req = urllib.request.Request(
            f"{gw.group(1)}/v2/models/affine/infer", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:  # routed to the server DNS discovery found
            assert json.loads(r.read())["outputs"][0]["data"] == [3.0] * 4
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "stopped the gateway and all servers" in rest
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def _tritons_serving(repo: Path) -> list[int]:
    """Live (not zombie) tritonserver processes whose command line names `repo`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or str(repo).encode() not in (entry / "cmdline").read_bytes():
                continue
            status = (entry / "status").read_text()
        except OSError:  # it ended while we looked
            continue
        if "tritonserver" in status.split("\n", 1)[0] and "zombie" not in status:
            pids.append(int(entry.name))
    return pids


@dataclass
class GatedRegion:
    """A region's autoscaler whose servers' model loads wait for a gate file (each leaves a marker)."""

    scaler: RegionAutoscaler
    repo: Path
    gate: Path
    dns: LoopbackDns

    def loading(self) -> int:
        """Servers whose model load has started and waits for the gate."""
        return len(list(self.gate.parent.glob(f"{self.gate.name}.*.waiting")))

    def hosts_serving(self) -> list[str]:
        """The loopback address of each live Triton of this region."""
        hosts = []
        for pid in _tritons_serving(self.repo):
            with contextlib.suppress(OSError):
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                hosts += [a.split(b"=", 1)[1].decode() for a in args if a.startswith(b"--http-address=")]
        return sorted(hosts)


@pytest.fixture
def gated_region(tmp_path: Path, prepared_triton: PreparedTriton) -> Iterator[GatedRegion]:
    repo = (tmp_path / "repo").resolve()  # as the spec names it
    write_python_model(repo, "held", SLOW_PY.format(sleep_s=0))
    gate = tmp_path / "load-may-finish"
    code = repo / "held" / "1" / "model.py"
    code.write_text(  # the model's load, in Triton's Python stub, waits for the gate
        code.read_text()
        + "\n\nimport os as _os, pathlib as _pathlib, time as _time\n"
        + f"_pathlib.Path({str(gate)!r} + f'.{{_os.getpid()}}.waiting').touch()\n"
        + f"while not _pathlib.Path({str(gate)!r}).exists():\n    _time.sleep(0.01)\n"
    )
    dns = LoopbackDns()
    scaler = RegionAutoscaler(
        "local",
        0,
        AutoscalePolicy(signal="inflight", target=1.0, min_servers=1, max_servers=2),
        {"repository": repo, "model_control_mode": "none", "stop_timeout_s": 3.0},
        tmp_path / "logs",
        prepared_triton,
        dns,
    )
    try:
        yield GatedRegion(scaler, repo, gate, dns)
    finally:
        gate.touch()
        scaler.stop()
        for pid in _tritons_serving(repo):  # what a failed run left: the next test must not find it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        dns.close()


@pytest.mark.parametrize("shutdown", ["stop", "pause_then_stop"])
def test_stopping_during_a_scale_up_leaves_no_server_running(
    gated_region: GatedRegion, shutdown: str
) -> None:
    """`skewserve up --autoscale` stopped (Ctrl-C) while a server it is adding still loads its models:
    that server is stopped with the others, not left running unpublished after the command exits.
    `pause_then_stop` is the stack's order: scaling paused first, the load finishing while the gateway
    goes away, the servers stopped last."""
    region, scaler = gated_region, gated_region.scaler
    adding = threading.Thread(target=scaler.add, args=(1,), daemon=True)  # as the control loop adds
    adding.start()
    try:
        wait_until(lambda: region.loading() == 1, 120, "the new server to load its model")
        assert len(_tritons_serving(region.repo)) == 1
        if shutdown == "pause_then_stop":
            scaler.pause()
            region.gate.touch()
            adding.join(120)
            assert not adding.is_alive() and len(_tritons_serving(region.repo)) == 1  # ready, not published
        scaler.stop()
        assert _tritons_serving(region.repo) == []
        adding.join(60)
        assert not adding.is_alive()
        assert (
            scaler.servers == {} and region.dns.addresses(scaler.dns_name) == frozenset()
        )  # never published
    finally:
        region.gate.touch()
        adding.join(60)


def test_a_host_still_loading_is_not_given_a_second_server(gated_region: GatedRegion) -> None:
    """Two scale-ups while the first's server still loads: the second server gets the next address
    (the same address and ports twice would leave the second unable to bind)."""
    region, scaler = gated_region, gated_region.scaler
    adds = [threading.Thread(target=scaler.add, args=(1,), daemon=True) for _ in range(2)]
    try:
        adds[0].start()
        wait_until(lambda: region.loading() == 1, 120, "the first server to load its model")
        adds[1].start()
        wait_until(lambda: region.loading() == 2, 120, "the second server to load its model")
        assert region.hosts_serving() == ["127.10.0.1", "127.10.0.2"]
        region.gate.touch()
        for thread in adds:
            thread.join(120)
            assert not thread.is_alive()
        assert sorted(scaler.servers) == ["127.10.0.1", "127.10.0.2"]
        assert region.dns.addresses(scaler.dns_name) == frozenset(scaler.servers)
    finally:
        region.gate.touch()
        for thread in adds:
            if thread.ident is not None:
                thread.join(60)


def test_a_launch_the_os_refuses_leaves_none_of_its_step_running(
    gated_region: GatedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale-up of two whose second process the OS refuses (out of file descriptors): the error is
    raised and the first server, already launched, is stopped rather than left loading unpublished."""
    region, scaler = gated_region, gated_region.scaler
    launch = TritonServer._launch
    launched: list[TritonServer] = []

    def refused_second(server: TritonServer, prepared: PreparedTriton) -> None:
        launched.append(server)
        if len(launched) == 2:
            raise OSError(errno.EMFILE, "Too many open files")
        launch(server, prepared)

    monkeypatch.setattr(TritonServer, "_launch", refused_second)
    with pytest.raises(OSError, match="Too many open files"):
        scaler.add(2)
    assert len(launched) == 2
    assert _tritons_serving(region.repo) == [] and scaler.servers == {}
    assert region.dns.addresses(scaler.dns_name) == frozenset()
