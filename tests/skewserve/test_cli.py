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

SKEWSERVE = [sys.executable, "-m", "skewserve"]


def test_help_lists_exactly_the_products_commands() -> None:
    res = subprocess.run([*SKEWSERVE, "--help"], capture_output=True, text=True, check=True)
    commands = res.stdout.split("\nCommands:\n", 1)[1]
    names = [line.split()[0] for line in commands.splitlines() if line.strip()]
    assert names == [
        "train",
        "export",
        "rollout",
        "rollback",
        "state",
        "canary",
        "controller",
        "up",
        "loadtest",
        "plan",
        "demo",
        "triton",
        "gateway",
        "data",
        "cascade",
    ]
    assert "  triton      Run real tritonserver processes locally (CPU profile).\n" in commands
    assert "  data        Data sets: generate long-tailed data, inspect class balance.\n" in commands


def table_rows(text: str) -> list[list[str]]:
    """The cells of each row (header included) of the Rich tables in `text`."""
    rows = [re.split(r"[│┃]", line)[1:-1] for line in text.splitlines() if line[:1] in "│┃"]
    return [[cell.strip() for cell in row] for row in rows]


def test_data_synth_then_inspect(tmp_path: Path) -> None:
    from training.data import load_data_dir

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
    assert synth.stdout.splitlines() == [
        f"wrote {tmp_path}/train.parquet, {tmp_path}/val.parquet, {tmp_path}/test.parquet",
        "training class sizes: [200, 74, 27, 10] (ratio 20)",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dataset.json",
        "test.parquet",
        "train.parquet",
        "val.parquet",
    ]
    out = subprocess.run(
        [*SKEWSERVE, "data", "inspect", "--data", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path}: 16 features, 4 classes"
    # Long-tailed training split, balanced validation and test splits (the long-tail protocol).
    assert table_rows(out) == [
        ["class", "train", "val", "test"],
        ["class_00", "200", "100", "200"],
        ["class_01", "74", "100", "200"],
        ["class_02", "27", "100", "200"],
        ["class_03", "10", "100", "200"],
    ]
    data_hash = load_data_dir(tmp_path, "label").data_hash[:12]
    assert lines[-1] == f"training imbalance ratio (largest/smallest class): 20.0; data hash {data_hash}"
    (tmp_path / "val.parquet").unlink()
    res = subprocess.run(
        [*SKEWSERVE, "data", "inspect", "--data", str(tmp_path)], capture_output=True, text=True
    )
    assert (res.returncode, res.stdout) == (
        1,
        f"error: {tmp_path} has no val.parquet or val.csv (or pass --val-fraction to split it off train)\n",
    )
    res = subprocess.run(
        [*SKEWSERVE, "data", "inspect", "--data", str(tmp_path), "--val-fraction", "0.25"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {r[0]: r[1:] for r in table_rows(res.stdout)[1:]}
    assert all(int(val) >= 1 for _train, val, *_ in rows.values()), res.stdout


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
        rows = table_rows(text)
        assert rows[0] == ["region", "server", "http", "grpc", "metrics", "pid"], text
        assert [row[0] for row in rows[1:]] == ["us-east", "eu-west"], text
        for _region, _name, http, grpc, metrics, pid in rows[1:]:
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", http), http
            assert re.fullmatch(r"127\.0\.0\.1:\d+", grpc), grpc
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", metrics), metrics
            assert pid.isdigit()
            # Each listed server answers, with the model it was given.
            client = httpclient.InferenceServerClient(http.removeprefix("http://"))
            x = np.ones((1, 4), dtype=np.float32)
            inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            inp.set_data_from_numpy(x)
            np.testing.assert_array_equal(client.infer("affine", [inp]).as_numpy("OUTPUT0"), x * 2 + 1)
        assert text.splitlines()[-2:] == [f"logs: {tmp_path / 'logs'}", "serving; press Ctrl-C to stop"]
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert rest.splitlines()[-1] == "stopped all servers", rest
        # Ctrl-C stopped the servers, not only the command.
        for *_, pid in rows[1:]:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_triton_up_rejects_empty_regions(affine_repo: Path) -> None:
    res = subprocess.run(
        [*SKEWSERVE, "triton", "up", "--repo", str(affine_repo), "--regions", ","],
        capture_output=True,
        text=True,
    )
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines()[-1] == (
        "Error: Invalid value for --regions: give at least one region name, e.g. --regions us-east,eu-west"
    )


def test_up_serves_the_repo_it_is_given_and_stops_everything_when_its_gateway_dies(
    affine_repo: Path, tmp_path: Path
) -> None:
    """Issue 25 items 1 and 3: `up --repo`, the models it loaded printed, and a dead gateway noticed."""
    import os

    cfg = tmp_path / "elsewhere" / "stack.yaml"
    cfg.parent.mkdir()
    cfg.write_text(
        "repository: ../model_repository\nmodel_config_name: local\nregions: {us-east: 1}\n"
        "gateway: {home_region: us-east, listen: {host: 127.0.0.1, http_port: 0, grpc_port: 0, ops_port: 0}}\n"
    )
    with cli_process(
        "up", "--config", str(cfg), "--repo", str(affine_repo), "--log-dir", str(tmp_path / "logs")
    ) as proc:
        text = read_until(proc, "press Ctrl-C")
        assert f"model repository {affine_repo.resolve()}" in text, text
        assert "models loaded: affine" in text, text
        rows = {row[0]: row for row in table_rows(text)[1:]}
        gateway_pid, triton_pid = int(rows["gateway"][-1]), int(rows["triton"][-1])
        os.kill(gateway_pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, rest
    assert "error: the gateway exited with code -9; see" in rest
    assert (
        "stopping every server of the stack" in rest
        and rest.splitlines()[-1] == "stopped the gateway and all servers"
    )
    assert (
        not Path(f"/proc/{triton_pid}").exists() or "zombie" in Path(f"/proc/{triton_pid}/status").read_text()
    )


def test_rollout_takes_the_stack_config_up_takes(affine_repo: Path, tmp_path: Path) -> None:
    """Issue 25 item 2: the servers come from the running stack, the repository from its config."""
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(
        f"repository: {affine_repo}\nmodel_config_name: local\nregions: {{us-east: 1}}\n"
        "gateway: {home_region: us-east, listen: {host: 127.0.0.1, http_port: 0, grpc_port: 0, ops_port: 0}}\n"
    )
    logs = tmp_path / "logs"
    rollout = [
        *SKEWSERVE,
        "rollout",
        "affine",
        "--version",
        "1",
        "--config",
        str(cfg),
        "--log-dir",
        str(logs),
    ]
    res = subprocess.run(rollout, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr
    assert res.stdout.strip() == (
        f"rollout failed: {cfg} is a stack config, but no stack is running with --log-dir {logs} "
        f"({logs / 'gateway.generated.yaml'} is missing): start it with `skewserve up --config {cfg}`, or "
        "pass its --log-dir"
    )
    with cli_process("up", "--config", str(cfg), "--log-dir", str(logs)) as proc:
        read_until(proc, "press Ctrl-C")
        res = subprocess.run(rollout, capture_output=True, text=True, timeout=60)
    # It reached the stack's server and looked in the stack's repository (affine has no model card).
    assert res.returncode == 1, res.stdout + res.stderr
    assert (
        res.stdout.strip()
        == f"rollout failed: affine version 1 is not published in {affine_repo} (no model_card.json); export it first"
    )
