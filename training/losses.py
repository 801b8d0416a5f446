"""Losses for long-tailed classification, each returning per-sample values (reduction is the loop's job).

- ce: plain cross-entropy.
- weighted_ce: cross-entropy weighted per class by inverse frequency, or by the inverse "effective
  number" (1 - beta^n) / (1 - beta) (Cui et al., CVPR 2019). Weights are normalised to mean 1.
- focal: (1 - p_t)^gamma * CE (Lin et al., ICCV 2017).
- logit_adjusted: CE on logits + tau * log(prior) (Menon et al., ICLR 2021, eq. 10).
- balanced_softmax: CE on logits + log(n_c) (Ren et al., NeurIPS 2020); equal to logit_adjusted
  at tau = 1 since log(n_c) and log(prior) differ by a constant that softmax ignores.
The adjusted losses change training only; at inference the raw logits are used as-is.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LossName = Literal["ce", "weighted_ce", "effective_ce", "focal", "logit_adjusted", "balanced_softmax"]
LOSS_NAMES: tuple[str, ...] = (
    "ce",
    "weighted_ce",
    "effective_ce",
    "focal",
    "logit_adjusted",
    "balanced_softmax",
)


def inverse_frequency_weights(counts: np.ndarray) -> np.ndarray:
    counts = np.maximum(counts.astype(np.float64), 1.0)
    w = 1.0 / counts
    return w * len(w) / w.sum()


def effective_number_weights(counts: np.ndarray, beta: float = 0.999) -> np.ndarray:
    counts = np.maximum(counts.astype(np.float64), 1.0)
    w = (1.0 - beta) / (1.0 - np.power(beta, counts))
    return w * len(w) / w.sum()


class SkewLoss(nn.Module):
    """One of the losses above, configured once with the training class counts."""

    class_weights: torch.Tensor
    logit_offset: torch.Tensor

    def __init__(
        self, name: str, class_counts: np.ndarray, tau: float = 1.0, gamma: float = 2.0, beta: float = 0.999
    ) -> None:
        super().__init__()
        if name not in LOSS_NAMES:
            raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSS_NAMES)}")
        self.name = name
        self.gamma = gamma
        counts = np.maximum(np.asarray(class_counts, dtype=np.float64), 1.0)
        prior = counts / counts.sum()
        weights = {
            "weighted_ce": inverse_frequency_weights(counts),
            "effective_ce": effective_number_weights(counts, beta),
        }.get(name, np.ones_like(counts))
        offset = {
            "logit_adjusted": tau * np.log(prior),
            "balanced_softmax": np.log(counts),
        }.get(name, np.zeros_like(counts))
        self.register_buffer("class_weights", torch.tensor(weights, dtype=torch.float32))
        self.register_buffer("logit_offset", torch.tensor(offset, dtype=torch.float32))

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.name in ("logit_adjusted", "balanced_softmax"):
            return F.cross_entropy(logits + self.logit_offset, target, reduction="none")
        ce = F.cross_entropy(logits, target, reduction="none")
        if self.name == "focal":
            p_t = torch.exp(-ce)
            return (1.0 - p_t).pow(self.gamma) * ce
        if self.name in ("weighted_ce", "effective_ce"):
            return self.class_weights[target] * ce
        return ce
