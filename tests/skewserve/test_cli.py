"""`skewserve` command line, run as a real subprocess."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from tests.process_helpers import cli_process, read_until

SKEWSERVE = [sys.executable, "-m", "skewserve.cli"]


def test_help_shows_the_product_shape() -> None:
    out = subprocess.run([*SKEWSERVE, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("data", "train", "export", "rollout", "triton", "gateway", "up", "loadtest", "demo"):
        assert command in out


def test_data_synth_then_inspect(tmp_path: Path) -> None:
    synth = subprocess.run(
        [
            *SKEWSERVE,
            "data",
            "synth",
            "--out",
            str(tmp_path),
            "--classes",
            "4",
            "--imbalance-ratio",
            "20",
            "--n-max",
            "200",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "training class sizes: [200, 74, 27, 10] (ratio 20)" in synth.stdout
    out = subprocess.run(
        [*SKEWSERVE, "data", "inspect", "--data", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "imbalance ratio (largest/smallest class): 20.0" in out and "class_03" in out
    (tmp_path / "val.parquet").unlink()
    res = subprocess.run(
        [*SKEWSERVE, "data", "inspect", "--data", str(tmp_path)], capture_output=True, text=True
    )
    assert res.returncode == 1 and "has no val.parquet or val.csv" in res.stdout


def test_triton_up_serves_until_interrupted(affine_repo: Path, tmp_path: Path) -> None:
    with cli_process(
        "triton",
        "up",
        "--repo",
        str(affine_repo),
        "--regions",
        "us-east,eu-west",
        "--per-region",
        "1",
        "--log-dir",
        str(tmp_path / "logs"),
    ) as proc:
        text = read_until(proc, "press Ctrl-C")
        urls = re.findall(r"http://127\.0\.0\.1:(\d+)\s", text)
        assert "us-east" in text and "eu-west" in text, text
        assert len(urls) >= 2, text
        client = httpclient.InferenceServerClient(f"127.0.0.1:{urls[0]}")
        x = np.ones((1, 4), dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("affine", [inp]).as_numpy("OUTPUT0"), x * 2 + 1)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert "stopped all servers" in rest


def test_triton_up_rejects_empty_regions(affine_repo: Path) -> None:
    res = subprocess.run(
        [*SKEWSERVE, "triton", "up", "--repo", str(affine_repo), "--regions", ","],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0
    assert "give at least one region name" in res.stdout + res.stderr
