"""`skewserve train`'s options are declared once (`TrainOptions`) and each reaches `TrainConfig`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer.main

from skewserve.commands.main import app
from skewserve.commands.train import TrainOptions
from training.config import TrainConfig
from training.errors import ModelError

# Every option set away from its default, so a value that does not reach the config shows.
ARGS = [
    "--data", "d", "--out", "o", "--label", "y", "--model", "pkg.mod:build", "--model-arg", "width=64",
    "--model-arg", "name=x", "--image-size", "32", "--channels", "3", "--no-augment", "--skip-bad-files",
    "--val-fraction", "0.2", "--data-workers", "2", "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
    "--rdzv-endpoint", "h:29500", "--rdzv-id", "job", "--rdzv-backend", "static", "--local-addr", "a",
    "--max-restarts", "3", "--device", "cpu", "--loss", "focal", "--sampler-q", "0.5", "--epochs", "7",
    "--max-steps", "99", "--min-steps", "9", "--input-noise", "0.3", "--checkpoint-every-steps", "5",
    "--batch-size", "64", "--lr", "0.01", "--width", "32", "--depth", "3", "--dropout", "0.2",
    "--precision", "fp32", "--patience", "40", "--no-speed-balance", "--slow-rank", "3",
    "--slow-factor", "2.5", "--seed", "11", "--resume", "--metrics-port", "9400", "--distill-from", "t",
    "--distill-weight", "0.7", "--distill-temperature", "3",
]  # fmt: skip

EXPECTED = {
    "data_dir": Path("d"), "out_dir": Path("o"), "label_column": "y", "model": "pkg.mod:build",
    "model_args": {"width": 64, "name": "x"}, "image_size": 32, "channels": 3, "augment": False,
    "skip_bad_files": True, "val_fraction": 0.2, "data_workers": 2, "nproc": 2, "nnodes": 2, "node_rank": 1,
    "rdzv_endpoint": "h:29500", "rdzv_id": "job", "rdzv_backend": "static", "local_addr": "a",
    "max_restarts": 3, "device": "cpu", "loss": "focal", "sampler_q": 0.5, "epochs": 7, "max_steps": 99,
    "min_steps": 9, "input_noise": 0.3, "checkpoint_every_steps": 5, "global_batch_size": 64, "lr": 0.01,
    "width": 32, "depth": 3, "dropout": 0.2, "precision": "fp32", "patience": 40, "speed_balance": False,
    "slow_rank": 3, "slow_factor": 2.5, "seed": 11, "resume": True, "distill_from": Path("t"),
    "distill_weight": 0.7, "distill_temperature": 3.0,
}  # fmt: skip


def parse(args: list[str]) -> TrainOptions:
    """The options as the command line parses `skewserve train ARGS` (nothing runs)."""
    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    return TrainOptions(**command.make_context("train", args).params)


def test_each_option_is_named_after_the_config_field_it_fills() -> None:
    names = {f.name for f in dataclasses.fields(TrainOptions)}
    assert names - set(TrainConfig.model_fields) == {"metrics_port"}


def test_every_option_reaches_the_config() -> None:
    options = parse(ARGS)
    assert options.metrics_port == 9400
    cfg = options.config()
    assert {name: getattr(cfg, name) for name in EXPECTED} == EXPECTED


def test_defaults_are_the_configs_and_patience_0_disables() -> None:
    cfg = parse(["--data", "d"]).config()
    assert cfg == TrainConfig(data_dir=Path("d"), out_dir=Path("runs/artifact"))
    assert parse(["--data", "d", "--patience", "0"]).config().patience is None


def test_a_model_arg_without_a_value_is_refused() -> None:
    with pytest.raises(ModelError, match="--model-arg 'width' must be KEY=VALUE"):
        parse(["--data", "d", "--model-arg", "width"]).config()
