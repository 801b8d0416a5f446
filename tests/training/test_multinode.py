"""Two torchrun agents on this machine as two nodes of one gloo job (c10d rendezvous on loopback).

Each "node" is a real `skewserve train` process whose torchrun agent launches one worker. The out
directory is the same path for both, as a checkpoint directory shared between nodes would be.
A node is lost by SIGKILLing its CLI, agent and worker; the job then resumes from the checkpoint.
A worker alone is lost by SIGKILLing it; the agents restart the job by themselves (--max-restarts).
Every wait is bounded in time and polls observable state (exit codes, files), never a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch

from skewserve.ports import free_port
from training.config import TrainConfig
from training.launch import torchrun_command, torchrun_env

pytestmark = pytest.mark.slow
WAIT_S = 240.0  # a bound on each phase on a loaded 2-core machine, not a duration under test


class Node:
    """One `skewserve train` process (CLI -> torchrun agent -> worker), in its own session."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skewserve", "train", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def worker(self) -> psutil.Process:
        """This node's training worker: the child of its torchrun agent running training.worker."""
        # the agent's own command line names the module too (`torch.distributed.run ... -m training.worker`)
        workers = [
            p
            for p in self.tree()
            if "training.worker" in (c := p.cmdline()) and "torch.distributed.run" not in c
        ]
        assert len(workers) == 1, f"expected one worker on {self.name}, found {workers}"
        return workers[0]

    def kill_node(self) -> None:
        """Lose the node: SIGKILL the CLI, its torchrun agent and the worker (own session), by pid."""
        tree = self.tree()
        self.killed = [(p.pid, " ".join(p.cmdline())[-80:]) for p in tree]
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_node()
            pytest.fail(f"node {self.name} did not exit within {timeout:.0f} s; log:\n{self.log()[-3000:]}")
        return self.proc.returncode

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_node()
        self._log.close()


@pytest.fixture()
def nodes(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    started: list[Node] = []

    def start(name: str, args: list[str]) -> Node:
        node = Node(name, args, tmp_path)
        started.append(node)
        return node

    yield start
    for node in started:  # a failed assertion must not leak agents or workers
        node.stop()


def _job_args(data: Path, out: Path, port: int, *extra: str) -> list[str]:
    return [
        "--data", str(data), "--out", str(out), "--nproc", "1", "--nnodes", "2",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "multinode-test", "--local-addr", "127.0.0.1",
        "--batch-size", "64", "--width", "32", "--seed", "3", *extra,
    ]  # fmt: skip


def _wait_for(predicate: Callable[[], bool], what: str, alive: list[Node]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        for node in alive:
            if node.proc.poll() is not None:
                pytest.fail(
                    f"node {node.name} exited ({node.proc.returncode}) before {what}:\n{node.log()[-3000:]}"
                )
        time.sleep(0.05)  # polling interval of an observable condition, not a wait-then-assert


def _epochs_logged(out: Path) -> int:
    path = out / "checkpoints" / "monitor-epochs.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_command_line_for_several_nodes_drops_standalone(tmp_path: Path) -> None:
    cfg = TrainConfig(
        data_dir=tmp_path,
        out_dir=tmp_path,
        nproc=4,
        nnodes=2,
        rdzv_endpoint="10.0.0.1:29400",
        rdzv_id="job7",
        max_restarts=3,
    )
    cmd = torchrun_command(cfg, tmp_path / "c.json")
    assert "--standalone" not in cmd
    assert cmd[3:10] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=job7",
        "--nproc-per-node=4",
        "--max-restarts=3",
        "-m",
    ]
    single = torchrun_command(TrainConfig(data_dir=tmp_path, out_dir=tmp_path, nproc=2), tmp_path / "c.json")
    assert single[3:7] == ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0"]
    with pytest.raises(ValueError, match="nnodes=2 needs rdzv_endpoint"):
        TrainConfig(data_dir=tmp_path, out_dir=tmp_path, nnodes=2)


def test_agents_get_a_fresh_store_per_rendezvous_round(tmp_path: Path) -> None:
    cfg = TrainConfig(data_dir=tmp_path, out_dir=tmp_path, nproc=2, threads_per_rank=1)
    assert torchrun_env(cfg, {})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert (
        torchrun_env(cfg, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
        == "0"
    )


def test_two_nodes_train_one_job(small_data: Path, tmp_path: Path, nodes: Callable[..., Node]) -> None:
    out, port = tmp_path / "art", free_port()
    a = nodes("node-a", _job_args(small_data, out, port, "--epochs", "2"))
    b = nodes("node-b", _job_args(small_data, out, port, "--epochs", "2"))
    assert a.wait() == 0, a.log()[-3000:]
    assert b.wait() == 0, b.log()[-3000:]
    meta = json.loads((out / "metadata.json").read_text())
    prov = meta["provenance"]
    assert (prov["world_size"], prov["nnodes"], prov["device"], prov["precision"]) == (2, 2, "cpu", "fp32")
    assert prov["resumed_from_epoch"] is None and prov["epochs_run"] == 2
    # one worker per node, each with its global rank's step log in the shared directory
    for rank in (0, 1):
        assert (out / "checkpoints" / f"monitor-rank{rank}.jsonl").read_text().count("\n") > 0


def test_job_resumes_across_nodes_after_a_node_is_killed(
    small_data: Path, tmp_path: Path, nodes: Callable[..., Node]
) -> None:
    out, epochs = tmp_path / "art", "16"
    port = free_port()
    a = nodes("node-a", _job_args(small_data, out, port, "--epochs", epochs, "--checkpoint-every-steps", "1"))
    b = nodes("node-b", _job_args(small_data, out, port, "--epochs", epochs, "--checkpoint-every-steps", "1"))
    _wait_for(
        lambda: _epochs_logged(out) >= 2 and (out / "checkpoints" / "last.pt").is_file(), "2 epochs", [a, b]
    )
    b.kill_node()
    assert a.wait(120) != 0, b.killed  # its peer is gone: the surviving node's job fails rather than hangs
    assert not (out / "metadata.json").exists()
    saved = torch.load(out / "checkpoints" / "last.pt", weights_only=False)["epoch"]
    assert 1 <= saved < int(epochs) - 1

    port = free_port()
    args = _job_args(small_data, out, port, "--epochs", epochs, "--checkpoint-every-steps", "1", "--resume")
    a2, b2 = nodes("node-a2", args), nodes("node-b2", args)
    assert a2.wait() == 0, a2.log()[-3000:]
    assert b2.wait() == 0, b2.log()[-3000:]
    prov = json.loads((out / "metadata.json").read_text())["provenance"]
    assert (prov["world_size"], prov["resumed_from_epoch"]) == (2, saved)
    assert f"resumed from epoch {saved}" in a2.log() + b2.log()
    epochs_seen = [
        json.loads(x)["epoch"]
        for x in (out / "checkpoints" / "monitor-epochs.jsonl").read_text().splitlines()
    ]
    assert epochs_seen[-1] == int(epochs) - 1 and saved + 1 in epochs_seen


def _epochs_seen(out: Path) -> list[int]:
    lines = (out / "checkpoints" / "monitor-epochs.jsonl").read_text().splitlines()
    return [json.loads(x)["epoch"] for x in lines]


def test_agents_restart_the_job_after_a_worker_is_killed(
    small_data: Path, tmp_path: Path, nodes: Callable[..., Node]
) -> None:
    """SIGKILL one worker: both agents re-rendezvous and the job finishes by itself from the checkpoint."""
    out, epochs = tmp_path / "art", 16
    port = free_port()
    args = _job_args(
        small_data, out, port, "--epochs", str(epochs), "--checkpoint-every-steps", "1", "--max-restarts", "2"
    )
    a, b = nodes("node-a", args), nodes("node-b", args)
    _wait_for(
        lambda: _epochs_logged(out) >= 2 and (out / "checkpoints" / "last.pt").is_file(), "2 epochs", [a, b]
    )
    victim = b.worker()
    saved = torch.load(out / "checkpoints" / "last.pt", weights_only=False)["epoch"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    # no relaunch: the agents (CLI processes) survive and finish the job through torchrun's restart
    assert a.wait() == 0, a.log()[-3000:]
    assert b.wait() == 0, b.log()[-3000:]
    prov = json.loads((out / "metadata.json").read_text())["provenance"]
    resumed = prov["resumed_from_epoch"]
    assert prov["world_size"] == 2 and prov["elastic_restarts"] >= 1, prov
    # a checkpoint may land between reading last.pt and the kill: the job resumes from that one or later
    assert resumed is not None and saved <= resumed < epochs - 1, (saved, resumed)
    assert f"resumed from epoch {resumed} (elastic restart {prov['elastic_restarts']})" in a.log() + b.log()
    seen = _epochs_seen(out)
    assert seen[-1] == epochs - 1 and resumed + 1 in seen
