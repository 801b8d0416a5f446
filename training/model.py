"""The MLP classifier; standardisation lives inside forward so the exported graph takes raw features."""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import nn


class ModelSpec(BaseModel):
    n_features: int = Field(ge=1)
    n_classes: int = Field(ge=2)
    width: int = Field(default=128, ge=1)
    depth: int = Field(default=2, ge=1)
    dropout: float = Field(default=0.1, ge=0, lt=1)


class MLPClassifier(nn.Module):
    """Standardise -> [Linear -> GELU -> Dropout] x depth -> Linear (logits)."""

    feature_mean: torch.Tensor
    feature_std: torch.Tensor

    def __init__(
        self, spec: ModelSpec, mean: np.ndarray | None = None, std: np.ndarray | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer(
            "feature_mean",
            torch.as_tensor(mean if mean is not None else np.zeros(spec.n_features), dtype=torch.float32),
        )
        self.register_buffer(
            "feature_std",
            torch.as_tensor(std if std is not None else np.ones(spec.n_features), dtype=torch.float32),
        )
        layers: list[nn.Module] = []
        width_in = spec.n_features
        for _ in range(spec.depth):
            layers += [nn.Linear(width_in, spec.width), nn.GELU(), nn.Dropout(spec.dropout)]
            width_in = spec.width
        layers.append(nn.Linear(width_in, spec.n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.feature_mean) / self.feature_std)


def standardisation(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std per feature on the training split; constant columns get std 1 (no division by 0)."""
    mean = features.mean(axis=0, dtype=np.float64)
    std = features.std(axis=0, dtype=np.float64)
    std[std < 1e-12] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)
