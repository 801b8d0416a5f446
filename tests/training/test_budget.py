"""The step budget and early-stopping rule adapt to the data's size; a short real run proves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.budget import (
    SmoothedEarlyStopping,
    resolve_budget,
    resolve_input_noise,
    resolve_weight_decay,
)
from training.config import TrainConfig
from training.launch import train


def _cfg(tmp_path: Path, **kw: object) -> TrainConfig:
    return TrainConfig(data_dir=tmp_path, out_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_small_data_gets_the_step_floor_and_no_early_stopping(tmp_path: Path) -> None:
    # 300 rows, batch 256: 2 steps per epoch; 30 epochs would be 60 steps
    b = resolve_budget(_cfg(tmp_path), steps_per_epoch=2, n_val=60)
    assert (b.epochs, b.total_steps, b.patience_steps, b.select_best) == (500, 1000, None, False)
    assert "val split has 60 rows < 200" in b.reason


def test_large_data_gets_thirty_epochs_and_step_patience(tmp_path: Path) -> None:
    b = resolve_budget(_cfg(tmp_path), steps_per_epoch=400, n_val=5000)
    assert (b.epochs, b.total_steps, b.min_steps) == (30, 12000, 1000)
    assert (b.patience_steps, b.select_best, b.checkpoint_every_epochs) == (3000, True, 1)


def test_explicit_settings_win(tmp_path: Path) -> None:
    assert resolve_budget(_cfg(tmp_path, epochs=3), 10, 5000).total_steps == 30
    b = resolve_budget(_cfg(tmp_path, max_steps=95, patience=40, min_steps=20), 10, 5000)
    assert (b.epochs, b.total_steps, b.patience_steps, b.min_steps) == (10, 100, 40, 20)
    off = resolve_budget(_cfg(tmp_path, patience=None), 10, 5000)
    assert off.patience_steps is None and off.select_best
    assert resolve_budget(_cfg(tmp_path, checkpoint_every_steps=25), 10, 5000).checkpoint_every_epochs == 3


def test_smoothed_stopping_ignores_one_noisy_evaluation(tmp_path: Path) -> None:
    b = resolve_budget(_cfg(tmp_path, max_steps=1000, patience=30, min_steps=50), 10, 5000)
    es = SmoothedEarlyStopping(b, smoothing=0.5)
    assert es.observe(10, 0.50) == (True, False)
    assert es.observe(20, 0.90) == (True, False)  # smoothed 0.70: a lucky spike moves it half-way
    assert es.observe(30, 0.60) == (False, False)  # smoothed 0.65
    assert es.observe(40, 0.60) == (False, False)  # 20 steps stale, under min_steps
    assert es.observe(50, 0.60) == (False, True)  # 30 steps stale and past min_steps
    es2 = SmoothedEarlyStopping(b)
    es2.load_state_dict(es.state_dict())
    assert es2.state_dict() == es.state_dict()


def test_input_noise_scales_with_features_over_rows(tmp_path: Path) -> None:
    assert resolve_input_noise(_cfg(tmp_path), n_rows=5000, n_features=16) == pytest.approx(0.1697, abs=1e-4)
    assert resolve_input_noise(_cfg(tmp_path), n_rows=100, n_features=64) == 1.5
    assert resolve_input_noise(_cfg(tmp_path, input_noise=0.0), n_rows=100, n_features=64) == 0.0
    with pytest.raises(ValueError, match="input_noise must be >= 0 or 'auto', got -1.0"):
        _cfg(tmp_path, input_noise=-1.0)


def test_weight_decay_scales_with_features_over_rows(tmp_path: Path) -> None:
    # twice the auto input noise: 6 * sqrt(features / rows), capped at 3
    assert resolve_weight_decay(_cfg(tmp_path), n_rows=5000, n_features=16) == pytest.approx(0.3394, abs=1e-4)
    assert resolve_weight_decay(_cfg(tmp_path), n_rows=124, n_features=30) == pytest.approx(2.9512, abs=1e-4)
    assert resolve_weight_decay(_cfg(tmp_path), n_rows=36, n_features=13) == 3.0
    assert resolve_weight_decay(_cfg(tmp_path, weight_decay=0.5), n_rows=36, n_features=13) == 0.5
    with pytest.raises(ValueError, match="weight_decay must be >= 0 or 'auto', got -1.0"):
        _cfg(tmp_path, weight_decay=-1.0)


def test_budget_reaches_the_run(small_data: Path, tmp_path: Path) -> None:
    meta = train(
        TrainConfig(
            data_dir=small_data, out_dir=tmp_path / "a", max_steps=30, global_batch_size=64, progress=False
        )
    )
    prov = meta["provenance"]
    # 740 rows / 64 = 12 steps per epoch: 30 steps round up to 3 epochs
    assert (prov["epochs_run"], prov["steps_run"]) == (3, 36)
    assert prov["budget"].startswith("30 steps (--max-steps) = 3 epochs, 36 steps")
    assert prov["input_noise"] == pytest.approx(0.3119, abs=1e-3)  # 3 * sqrt(8 / 740)
    assert prov["weight_decay"] == pytest.approx(0.6238, abs=1e-3)  # 6 * sqrt(8 / 740)
    epochs = (tmp_path / "a" / "checkpoints" / "monitor-epochs.jsonl").read_text().splitlines()
    assert len(epochs) == 3 and "val_balanced_accuracy_smoothed" in json.loads(epochs[-1])
