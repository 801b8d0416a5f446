"""Training progress for people: a live bar on a terminal, one line per epoch anywhere else.

A carriage-return bar piped into a log file or CI is one endless line of redraws; without a terminal
(or with CI set, as CI systems do even when they fake one) each finished epoch is one plain line.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


def is_interactive(stream: TextIO) -> bool:
    """True when `stream` is a terminal a person watches, not a log or a CI console."""
    ci = os.environ.get("CI", "").strip().lower()
    if ci not in ("", "0", "false", "no"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


MAX_LINES = 50


class EpochProgress:
    """Progress of a run of `epochs` epochs of `steps_per_epoch` steps, resumed at `start_epoch`."""

    def __init__(
        self, epochs: int, steps_per_epoch: int, start_epoch: int = 0, stream: TextIO | None = None
    ) -> None:
        self.epochs = epochs
        # A log keeps at most about MAX_LINES epoch lines: a tiny data set can run 1,000 epochs.
        self.every = max(1, -(-epochs // MAX_LINES))
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        if is_interactive(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=epochs * steps_per_epoch,
                initial=start_epoch * steps_per_epoch,
                desc="train",
                unit="step",
                file=self.stream,
            )

    def step(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def end_epoch(self, epoch: int, loss: float, val_bacc: float, imbalance: float) -> None:
        """Show a finished epoch (0-based `epoch`, shown 1-based): on the bar, or as a line of its own
        (the first, the last and every `every`-th)."""
        if self._bar is not None:
            self._bar.set_postfix(
                epoch=epoch + 1, loss=f"{loss:.3f}", val_bacc=f"{val_bacc:.3f}", imbalance=f"{imbalance:.2f}"
            )
            return
        if (epoch + 1) % self.every and epoch + 1 != self.epochs and epoch != 0:
            return
        self.stream.write(
            f"train epoch {epoch + 1}/{self.epochs}: loss {loss:.3f}, val balanced acc {val_bacc:.3f}, "
            f"rank imbalance {imbalance:.2f}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
