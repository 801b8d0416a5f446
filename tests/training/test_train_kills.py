"""SIGKILL real training runs (the worker process for one rank, torchrun for two) and resume them.

The kill moment is observed, not planted: the test watches `checkpoints/last.pt` and kills the
whole process group (CLI, torchrun and its workers) a seeded random delay after epoch k's checkpoint
appears. The resumed run must end with exactly the weights and optimizer state of an uninterrupted
run of the same seed: CPU kernels are deterministic for a fixed thread count, the sampler's draw is
a function of (seed, epoch), dropout is re-seeded per (seed, epoch, rank), and the optimizer and LR
schedule are restored; nothing else can make the two runs differ, so the comparison is exact.
Rank-speed balancing is off here because its splits follow measured step times, which no two runs
share (the split never changes the update's value, only its floating-point summation order).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.waiting import wait_until
from training.checkpoint import CHECKPOINT_NAME, load_checkpoint
from training.config import TrainConfig
from training.launch import torchrun_command

SEED = 7
EPOCHS = 8


def _train_cmd(data: Path, out: Path, nproc: int, resume: bool = False) -> list[str]:
    """The real training processes: the worker for one rank, torchrun (gloo) for two."""
    cfg = TrainConfig(
        data_dir=data,
        out_dir=out,
        nproc=nproc,
        epochs=EPOCHS,
        patience=None,
        global_batch_size=16,
        width=32,
        seed=SEED,
        speed_balance=False,
        # One thread per rank: deterministic, and no OpenMP spinning when other tests share the cores.
        threads_per_rank=1,
        progress=False,
        resume=resume,
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train_config{'-resume' if resume else ''}.json"
    path.write_text(cfg.model_dump_json())
    if nproc == 1:
        return [sys.executable, "-m", "training.worker", "--config", str(path)]
    return torchrun_command(cfg, path)


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        # Own session: the kill reaches torchrun's workers too, as an OOM killer or a lost node would.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True, env=env)


def _checkpoint_epoch(out: Path) -> int:
    state = load_checkpoint(out / "checkpoints")  # raises if a kill ever left it torn
    return -1 if state is None else int(state["epoch"])


def _kill_after_epoch(proc: subprocess.Popen[bytes], out: Path, k: int, rng: random.Random) -> int:
    """SIGKILL the run's process group a random moment after epoch k's checkpoint; its last epoch."""
    path = out / "checkpoints" / CHECKPOINT_NAME
    seen: tuple[int, int] | None = None

    def checkpointed() -> bool:
        nonlocal seen
        assert proc.poll() is None, f"training exited ({proc.returncode}) before epoch {k} was checkpointed"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        stamp = (st.st_ino, st.st_mtime_ns)
        if stamp == seen:
            return False
        seen = stamp
        return _checkpoint_epoch(out) >= k

    # Polled often: the kill must land soon after this checkpoint, within the next epoch.
    wait_until(checkpointed, 120, f"the checkpoint of epoch {k}", interval=0.005)
    time.sleep(rng.uniform(0.0, 0.05))  # somewhere in the next epoch (or its checkpoint write)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "metadata.json").exists(), "a killed run wrote no artifact"
    return _checkpoint_epoch(out)


def _final_state(out: Path) -> dict[str, Any]:
    state = torch.load(out / "checkpoints" / CHECKPOINT_NAME, map_location="cpu", weights_only=False)
    assert state["epoch"] == EPOCHS - 1
    return state


def _assert_same_final_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0, msg=key)
    for pid, sa in a["optimizer"]["state"].items():
        for name, tensor in sa.items():
            torch.testing.assert_close(tensor, b["optimizer"]["state"][pid][name], rtol=0, atol=0)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]
    assert [h["val_balanced_accuracy"] for h in a["history"]] == [
        h["val_balanced_accuracy"] for h in b["history"]
    ]


def _killed_and_resumed(data: Path, tmp: Path, nproc: int, kills: list[int], rng: random.Random) -> Path:
    out, log = tmp / "killed", tmp / "killed.log"
    last = -1
    for i, k in enumerate(kills):
        proc = _start(_train_cmd(data, out, nproc, resume=i > 0), log)
        last = _kill_after_epoch(proc, out, max(k, last + 1), rng)
        # At least two epochs must still run after the kill for the comparison to mean anything.
        assert last <= EPOCHS - 3, f"killed too late (epoch {last} of {EPOCHS})"
    proc = _start(_train_cmd(data, out, nproc, resume=True), log)
    assert proc.wait(300) == 0, log.read_text()[-3000:]
    assert "resumed from epoch" in log.read_text()
    return out


def _uninterrupted(data: Path, tmp: Path, nproc: int) -> Path:
    out = tmp / "full"
    proc = _start(_train_cmd(data, out, nproc), tmp / "full.log")
    assert proc.wait(300) == 0, (tmp / "full.log").read_text()[-3000:]
    return out


def test_one_rank_killed_twice_resumes_to_the_uninterrupted_weights(small_data: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    full = _uninterrupted(small_data, tmp_path, 1)
    killed = _killed_and_resumed(small_data, tmp_path, 1, [rng.randint(1, 2), rng.randint(2, 3)], rng)
    _assert_same_final_state(_final_state(full), _final_state(killed))


@pytest.mark.slow
def test_two_rank_torchrun_killed_resumes_to_the_uninterrupted_weights(
    small_data: Path, tmp_path: Path
) -> None:
    rng = random.Random(SEED + 1)
    full = _uninterrupted(small_data, tmp_path, 2)
    killed = _killed_and_resumed(small_data, tmp_path, 2, [rng.randint(1, 2)], rng)
    _assert_same_final_state(_final_state(full), _final_state(killed))
