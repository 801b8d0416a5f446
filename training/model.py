"""The `mlp` family: tables (and any fixed-shape input, flattened); standardisation inside forward."""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import nn

from training.data_spec import DataSpec


class ModelSpec(BaseModel):
    n_features: int = Field(ge=1)
    n_classes: int = Field(ge=2)
    width: int = Field(default=128, ge=1)
    depth: int = Field(default=2, ge=1)
    dropout: float = Field(default=0.1, ge=0, lt=1)
    input_noise: float = Field(default=0.0, ge=0)


class MLPClassifier(nn.Module):
    """Standardise -> [Linear -> GELU -> Dropout] x depth -> Linear (logits).

    In training mode Gaussian noise of `input_noise` feature stds is added after standardisation:
    it smooths the boundary around a rare class's few rows (training/budget.py says why and how
    much); eval mode, and so every export, never adds it.
    """

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
        x = x.flatten(1)
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        z = (x.float() - self.feature_mean) / self.feature_std
        if self.training and self.spec.input_noise > 0:
            z = z + self.spec.input_noise * torch.randn_like(z)
        return self.net(z)


def build_mlp(
    data: DataSpec, width: int = 128, depth: int = 2, dropout: float = 0.1, input_noise: float = 0.0
) -> MLPClassifier:
    """The `mlp` factory: one fixed-shape input, flattened; tables carry per-feature mean and std."""
    if len(data.inputs) != 1 or -1 in data.inputs[0].shape:
        raise ValueError(
            f"the mlp family takes one fixed-shape input; this data has "
            f"{[(i.name, list(i.shape)) for i in data.inputs]}: use --model cnn, text or your own factory"
        )
    n = int(np.prod(data.inputs[0].shape))
    spec = ModelSpec(
        n_features=n,
        n_classes=data.n_classes,
        width=width,
        depth=depth,
        dropout=dropout,
        input_noise=input_noise,
    )
    mean = data.preprocessing.get("mean")
    std = data.preprocessing.get("std")
    if data.kind == "table" and mean is not None and std is not None:
        return MLPClassifier(spec, np.asarray(mean, np.float32), np.asarray(std, np.float32))
    return MLPClassifier(spec)


def standardisation(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std per feature on the training split; constant columns get std 1 (no division by 0)."""
    mean = features.mean(axis=0, dtype=np.float64)
    std = features.std(axis=0, dtype=np.float64)
    std[std < 1e-12] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)
