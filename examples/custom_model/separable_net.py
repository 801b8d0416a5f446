"""A user's own image classifier for skewserve: depthwise-separable convolutions + attention pooling.

Written as a user would: a module with a factory. skewserve calls `build(data, **model_args)` with a
description of the data (`data.inputs`: name, dtype and per-item shape of each input tensor;
`data.classes`, `data.class_counts`, `data.preprocessing`) and trains whatever module it returns,
with class-balanced sampling, the imbalance losses, rank-speed balancing and the skew monitor.

    skewserve train --data runs/digits --model examples/custom_model/separable_net.py:build \
        --model-arg width=24 --nproc 2 --out runs/separable
    skewserve export --artifact runs/separable --name separable

The forward pass takes the inputs in `data.inputs` order (here one uint8 image [C, H, W]) and
returns logits [batch, classes].
"""

from __future__ import annotations

import torch
from torch import nn


class SeparableBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False)
        self.pointwise = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.norm = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.pointwise(self.depthwise(x))))


class SeparableNet(nn.Module):
    def __init__(
        self, channels: int, n_classes: int, width: int, mean: list[float], std: list[float]
    ) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))
        self.stem = nn.Conv2d(channels, width, 3, 1, 1)
        self.blocks = nn.Sequential(SeparableBlock(width, width, 1), SeparableBlock(width, 2 * width, 2))
        self.attention = nn.Conv2d(2 * width, 1, 1)  # where to look, per position
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = (image.float() / 255.0 - self.mean) / self.std
        x = self.blocks(torch.relu(self.stem(x)))
        weights = torch.softmax(self.attention(x).flatten(2), dim=-1)  # [b, 1, h*w]
        pooled = (x.flatten(2) * weights).sum(-1)  # attention pooling over positions
        return self.head(pooled)


def build(data, width: int = 16) -> SeparableNet:  # noqa: ANN001 - skewserve's DataSpec
    (image,) = data.inputs
    channels = image.shape[0]
    pre = data.preprocessing
    return SeparableNet(
        channels,
        len(data.classes),
        width,
        pre.get("mean", [0.5] * channels),
        pre.get("std", [0.25] * channels),
    )
