"""The training run's random stream (dropout, input noise) is drawn only by training: a DataLoader
iterator draws its workers' base seed from torch's global generator unless given its own, so every
epoch's loader and every evaluation shifted what dropout and noise drew. That moved the 9-seed
defaults table (breast cancer 0.8861 -> 0.8769, digits 0.8828 -> 0.8811) when the data moved onto
DataLoaders; with their own generators the table is again what it was, value for value."""

from __future__ import annotations

from pathlib import Path

import torch

from training.config import TrainConfig
from training.worker import Trainer, evaluate


def test_loaders_never_draw_from_the_training_random_stream(small_data: Path, tmp_path: Path) -> None:
    trainer = Trainer(
        TrainConfig(
            data_dir=small_data, out_dir=tmp_path / "out", nproc=1, progress=False, threads_per_rank=1
        )
    )
    try:
        before = torch.get_rng_state()
        next(iter(trainer.loader))  # an epoch's batches
        evaluate(trainer.model, trainer.val_set, trainer.data.classes)  # an evaluation
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        trainer.monitor.close()
