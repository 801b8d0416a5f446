"""Training output a person can read in a log: epochs from 1, a thinned log for tiny data."""

from __future__ import annotations

import io

from training.progress import EpochProgress


def test_a_thousand_epochs_make_about_fifty_lines_from_one_to_the_last() -> None:
    out = io.StringIO()
    bar = EpochProgress(1000, 1, stream=out)
    for epoch in range(1000):
        bar.end_epoch(epoch, 0.5, 0.9, 1.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 51
    assert lines[0].startswith("train epoch 1/1000:") and lines[1].startswith("train epoch 20/1000:")
    assert lines[-1].startswith("train epoch 1000/1000:")


def test_short_runs_keep_every_epoch() -> None:
    out = io.StringIO()
    bar = EpochProgress(3, 1, stream=out)
    for epoch in range(3):
        bar.end_epoch(epoch, 0.5, 0.9, 1.0)
    assert [line.split(":")[0] for line in out.getvalue().splitlines()] == [
        "train epoch 1/3", "train epoch 2/3", "train epoch 3/3",
    ]  # fmt: skip
