"""How long to train and when to stop early, adapted to the data's size.

An epoch count fits one data size only: 30 epochs of a 256-row batch are 30 000 steps on a million
rows and 60 on three hundred, too few for the model to converge. The budget is therefore counted in
optimizer steps: `budget_epochs` passes over the data, but never fewer than `min_steps`.

Early stopping on a small validation split mostly reacts to noise: with 5 rows in a rare class one
prediction moves balanced accuracy by several points. It therefore watches an exponential moving
average of the validation metric, counts patience in steps, never stops before `min_steps`, and is
off altogether (and the final model kept, not the best-scoring one) when the validation split has
fewer than `early_stop_min_val_rows` rows: picking the best of hundreds of evaluations on a tiny
split selects noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from training.config import TrainConfig


@dataclass(frozen=True)
class StepBudget:
    epochs: int
    total_steps: int
    steps_per_epoch: int
    patience_steps: int | None  # None: no early stopping
    min_steps: int  # no early stop before this many steps
    select_best: bool  # keep the best-scoring weights (else the final ones)
    checkpoint_every_epochs: int
    reason: str  # how the budget and the early-stopping rule were chosen, for the logs and provenance


def resolve_budget(cfg: TrainConfig, steps_per_epoch: int, n_val: int) -> StepBudget:
    """The run's length and early-stopping rule from the config and the data's size."""
    if cfg.epochs is not None:
        epochs = cfg.epochs
        why = f"{epochs} epochs (--epochs)"
    else:
        steps = cfg.max_steps or max(cfg.min_steps, cfg.budget_epochs * steps_per_epoch)
        epochs = max(1, math.ceil(steps / steps_per_epoch))
        why = (
            f"{steps} steps (--max-steps)"
            if cfg.max_steps
            else f"max({cfg.min_steps} steps, {cfg.budget_epochs} epochs of {steps_per_epoch} steps)"
        )
    total = epochs * steps_per_epoch
    min_steps = min(cfg.min_steps, total)
    if cfg.patience is None:
        patience, select_best, rule = None, True, "early stopping off (--patience 0)"
    elif n_val < cfg.early_stop_min_val_rows:
        patience, select_best = None, False
        rule = (
            f"early stopping off: the val split has {n_val} rows < {cfg.early_stop_min_val_rows}; "
            "the final weights are kept"
        )
    else:
        patience = cfg.patience if cfg.patience != "auto" else max(cfg.min_steps // 2, total // 4)
        select_best = True
        rule = (
            f"early stopping on smoothed val balanced accuracy, patience {patience} steps after {min_steps}"
        )
    every = max(1, math.ceil(cfg.checkpoint_every_steps / steps_per_epoch))
    return StepBudget(
        epochs=epochs,
        total_steps=total,
        steps_per_epoch=steps_per_epoch,
        patience_steps=patience,
        min_steps=min_steps,
        select_best=select_best,
        checkpoint_every_epochs=every,
        reason=f"{why} = {epochs} epochs, {total} steps; {rule}",
    )


def resolve_input_noise(cfg: TrainConfig, n_rows: int, n_features: int) -> float:
    """Input-noise std (in feature stds): the config's value, or min(1.5, 3 * sqrt(features / rows)).

    Training with Gaussian input noise is equivalent to a Tikhonov (ridge-like) penalty (Bishop 1995,
    "Training with noise is equivalent to Tikhonov regularization"); as for ridge, the strength that
    fits scales with features / rows. On a long tail it matters most for the rare classes: their few
    rows become small clouds instead of points the network can fence in.
    """
    if cfg.input_noise != "auto":
        return float(cfg.input_noise)
    return float(min(1.5, 3.0 * math.sqrt(n_features / max(1, n_rows))))


def resolve_weight_decay(cfg: TrainConfig, n_rows: int, n_features: int) -> float:
    """AdamW weight decay: the config's value, or min(3, 6 * sqrt(features / rows)).

    Weight decay is the other ridge-like penalty, and it follows the same scaling as the input
    noise (twice its auto value): strong where a few rows must pin many weights, weak on large data,
    where a fixed decay only costs fit. A fixed 1.0 under-regularised small sets (breast cancer's
    124 rows of 30 features, with 2 rows in the rare class) and over-regularised the 5000-row one.
    """
    if cfg.weight_decay != "auto":
        return float(cfg.weight_decay)
    return float(min(3.0, 6.0 * math.sqrt(n_features / max(1, n_rows))))


class SmoothedEarlyStopping:
    """Tracks an EMA of the validation metric; says when it improved and when to stop."""

    def __init__(self, budget: StepBudget, smoothing: float = 0.3) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be within (0, 1], got {smoothing}")
        self.budget = budget
        self.smoothing = smoothing
        self.smoothed: float | None = None
        self.best = -math.inf
        self.best_step = -1

    def observe(self, step: int, metric: float) -> tuple[bool, bool]:
        """Fold in the metric measured after `step` optimizer steps; return (improved, stop)."""
        a = self.smoothing
        self.smoothed = metric if self.smoothed is None else a * metric + (1 - a) * self.smoothed
        improved = self.smoothed > self.best
        if improved:
            self.best, self.best_step = self.smoothed, step
        p = self.budget.patience_steps
        stop = p is not None and step >= self.budget.min_steps and step - self.best_step >= p
        return improved, stop

    def state_dict(self) -> dict[str, Any]:
        return {"smoothed": self.smoothed, "best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.smoothed, self.best, self.best_step = state["smoothed"], state["best"], state["best_step"]
