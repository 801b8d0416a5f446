"""Real training runs: torchrun with 2 gloo ranks, resume refusals, CLI errors (kills: test_train_kills.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skewserve.ports import free_port
from training.config import TrainConfig
from training.errors import CheckpointError, TrainingError
from training.launch import train
from training.metrics_export import PORT_ENV
from training.monitor import SkewMonitor


@pytest.mark.slow
def test_torchrun_two_ranks_writes_a_complete_artifact(small_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    cfg = TrainConfig(
        data_dir=small_data,
        out_dir=out,
        nproc=2,
        epochs=3,
        global_batch_size=64,
        slow_rank=1,
        slow_factor=2.0,
        precision="bf16",
        progress=False,
    )
    meta = train(cfg, log_path=tmp_path / "torchrun.log")
    for name in ("model.pt", "metadata.json", "metrics.json", "confusion_matrix.png", "checkpoints/last.pt"):
        assert (out / name).is_file(), name
    assert not (out / "train_config.json").exists()  # the workers' copy is gone once they finished
    assert meta["format_version"] == 2
    assert meta["model"] == {"kind": "builtin", "name": "mlp", "args": meta["model"]["args"]}
    assert meta["inputs"] == [{"name": "features", "dtype": "float32", "shape": [8]}]
    assert meta["provenance"]["world_size"] == 2 and meta["provenance"]["precision"] == "bf16"
    assert meta["classes"] == [f"class_{i:02d}" for i in range(5)]
    assert meta["preprocessing"]["feature_names"] == [f"f{i:02d}" for i in range(8)]
    assert len(meta["preprocessing"]["mean"]) == 8 and abs(sum(meta["class_priors"]) - 1) < 1e-9
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {"val", "test"} and len(metrics["test"]["confusion_matrix"]) == 5
    # both ranks wrote step records; epoch summaries carry the imbalance ratio and class counts
    for rank in (0, 1):
        rows = (out / "checkpoints" / f"monitor-rank{rank}.jsonl").read_text().splitlines()
        rec = json.loads(rows[0])
        assert {"compute_s", "data_wait_s", "allreduce_wait_s", "samples_per_s"} <= set(rec)
    epochs = [json.loads(x) for x in (out / "checkpoints" / "monitor-epochs.jsonl").read_text().splitlines()]
    assert len(epochs) == 3
    assert all(e["imbalance_ratio"] >= 1.0 for e in epochs)
    assert sum(epochs[0]["class_counts_seen"]) == sum(epochs[0]["samples_per_rank"])
    # the slowed rank gets the smaller share once measured
    assert epochs[-1]["rank_shares"][1] < epochs[-1]["rank_shares"][0]


def test_resume_refuses_changed_settings(small_data: Path, tmp_path: Path) -> None:
    train(TrainConfig(data_dir=small_data, out_dir=tmp_path / "r", epochs=1, progress=False))
    with pytest.raises(CheckpointError, match="loss: checkpoint 'logit_adjusted' vs now 'focal'"):
        train(
            TrainConfig(
                data_dir=small_data,
                out_dir=tmp_path / "r",
                epochs=1,
                loss="focal",
                resume=True,
                progress=False,
            )
        )


def _open_files_under(folder: Path) -> list[str]:
    """This process's open file descriptors that point into `folder` (from /proc)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(folder)):
                found.append(target)
    return found


def test_a_refused_run_in_process_gives_back_its_metrics_port_and_files(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train` in-process (the Python API) that fails after the trainer was built must close what the
    trainer opened: its live metrics listener and its step log. Otherwise a retry in the same process
    finds the port taken, and every failed run holds a file."""
    monkeypatch.setenv(PORT_ENV, str(free_port()))
    out = tmp_path / "r"
    train(TrainConfig(data_dir=small_data, out_dir=out, epochs=1, progress=False))
    changed = TrainConfig(
        data_dir=small_data, out_dir=out, epochs=1, loss="focal", resume=True, progress=False
    )
    for _ in range(2):  # the second refusal needs the port the first one served on
        with pytest.raises(CheckpointError, match="loss: checkpoint 'logit_adjusted' vs now 'focal'"):
            train(changed)
    assert _open_files_under(out) == []


def test_a_failing_close_does_not_hide_why_the_run_failed(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"
    train(TrainConfig(data_dir=small_data, out_dir=out, epochs=1, progress=False))
    close = SkewMonitor.close

    def close_then_fail(monitor: SkewMonitor) -> None:
        close(monitor)
        raise OSError("the step log's disk went away")

    monkeypatch.setattr(SkewMonitor, "close", close_then_fail)
    with pytest.raises(CheckpointError, match="loss: checkpoint 'logit_adjusted' vs now 'focal'"):
        train(
            TrainConfig(data_dir=small_data, out_dir=out, epochs=1, loss="focal", resume=True, progress=False)
        )


def test_config_contradictions_name_field_and_fix(small_data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"global_batch_size \(1\) must be at least nproc \(2\)"):
        TrainConfig(data_dir=small_data, out_dir=tmp_path, nproc=2, global_batch_size=1)
    with pytest.raises(ValueError, match="slow_rank 3 does not exist with nproc=2"):
        TrainConfig(data_dir=small_data, out_dir=tmp_path, nproc=2, slow_rank=3)


def test_cli_train_reports_bad_data(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text("a,label\n1,x\n2,y\n")
    (tmp_path / "val.csv").write_text("a,label\n1,x\n2,q\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "skewserve",
            "train",
            "--data",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1
    assert "classes ['q'] appear in the val split but not in training" in res.stdout


def test_bad_data_with_two_ranks_is_one_line_before_torchrun_starts(tmp_path: Path) -> None:
    """Issue 25 item 4: the data is checked once in the launcher, not by every rank."""
    (tmp_path / "train.csv").write_text("a,b,label\n1,,x\n2,inf,y\n,3,y\n")
    (tmp_path / "val.csv").write_text("a,b,label\n1,1,x\n2,2,y\n")
    res = subprocess.run(
        [sys.executable, "-m", "skewserve", "train", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
         "--nproc", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1
    out = res.stdout + res.stderr
    assert "Traceback" not in out and "torch.distributed" not in out
    # Every column's problem at once, with its counts.
    assert (
        "error: feature column 'a' in the train split has 1 non-finite values (1 NaN, 0 inf); impute or "
        "drop those rows; feature column 'b' in the train split has 2 non-finite values (1 NaN, 1 inf); "
        "impute or drop those rows"
    ) in res.stdout
    assert not (tmp_path / "o" / "train_config.json").exists()


def test_data_inspect_warns_of_missing_and_singleton_classes(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text("a,label\n1,x\n2,x\n3,y\n4,z\n5,z\n")
    (tmp_path / "val.csv").write_text("a,label\n1,x\n2,y\n")
    res = subprocess.run(
        [sys.executable, "-m", "skewserve", "data", "inspect", "--data", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "warning: classes with a single training item: ['y']; their recall will be noisy" in res.stdout
    assert (
        "warning: the val split has no items of classes ['z']: its balanced accuracy covers only the "
        "classes it holds"
    ) in res.stdout


def test_failing_torchrun_is_reported(tmp_path: Path, small_data: Path) -> None:
    cfg = TrainConfig(
        data_dir=small_data, out_dir=tmp_path / "o", nproc=2, epochs=1, progress=False, precision="fp16"
    )
    with pytest.raises(TrainingError, match="torchrun exited with code 1"):
        train(cfg, log_path=tmp_path / "log")
    assert "precision fp16 needs a CUDA GPU" in (tmp_path / "log").read_text()
