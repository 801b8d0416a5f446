"""Each loss against its formula written out directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.losses import LOSS_NAMES, SkewLoss

COUNTS = np.array([500, 100, 20, 5])
torch.manual_seed(0)
LOGITS = torch.randn(32, 4)
TARGET = torch.randint(0, 4, (32,))


def _log_softmax(z: torch.Tensor) -> torch.Tensor:
    return z - torch.logsumexp(z, dim=1, keepdim=True)


def _nll(z: torch.Tensor) -> torch.Tensor:
    return -_log_softmax(z)[torch.arange(len(TARGET)), TARGET]


def test_ce() -> None:
    torch.testing.assert_close(SkewLoss("ce", COUNTS)(LOGITS, TARGET), _nll(LOGITS))


def test_inverse_frequency_weighted_ce() -> None:
    w = 1.0 / COUNTS
    w = w * 4 / w.sum()
    want = torch.tensor(w, dtype=torch.float32)[TARGET] * _nll(LOGITS)
    torch.testing.assert_close(SkewLoss("weighted_ce", COUNTS)(LOGITS, TARGET), want)


def test_effective_number_weighted_ce() -> None:
    beta = 0.999
    w = (1 - beta) / (1 - beta**COUNTS)
    w = w * 4 / w.sum()
    want = torch.tensor(w, dtype=torch.float32)[TARGET] * _nll(LOGITS)
    torch.testing.assert_close(SkewLoss("effective_ce", COUNTS, beta=beta)(LOGITS, TARGET), want)


def test_focal() -> None:
    p_t = torch.softmax(LOGITS, 1)[torch.arange(32), TARGET]
    want = -((1 - p_t) ** 2) * torch.log(p_t)
    torch.testing.assert_close(SkewLoss("focal", COUNTS, gamma=2.0)(LOGITS, TARGET), want)


def test_logit_adjusted() -> None:
    prior = torch.tensor(COUNTS / COUNTS.sum(), dtype=torch.float32)
    want = _nll(LOGITS + 0.7 * torch.log(prior))
    torch.testing.assert_close(SkewLoss("logit_adjusted", COUNTS, tau=0.7)(LOGITS, TARGET), want)


def test_balanced_softmax_equals_logit_adjusted_at_tau_one() -> None:
    want = _nll(LOGITS + torch.log(torch.tensor(COUNTS, dtype=torch.float32)))
    got = SkewLoss("balanced_softmax", COUNTS)(LOGITS, TARGET)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, SkewLoss("logit_adjusted", COUNTS, tau=1.0)(LOGITS, TARGET))


def test_unknown_loss_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown loss 'hinge'; choose one of " + ", ".join(LOSS_NAMES)):
        SkewLoss("hinge", COUNTS)
