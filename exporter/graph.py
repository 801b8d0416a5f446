"""The serving module: raw FP32 features in; logits, softmax probabilities and arg-max label out."""

from __future__ import annotations

import torch
from torch import nn

from training.model import MLPClassifier


class ServingModule(nn.Module):
    def __init__(self, model: MLPClassifier) -> None:
        super().__init__()
        self.model = model
        self.eval()  # serving never runs dropout

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.model(features)  # standardisation happens inside the trained module
        return logits, torch.softmax(logits, dim=1), torch.argmax(logits, dim=1, keepdim=True)
