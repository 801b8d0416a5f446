"""The `cnn` family: a ResNet for small images (He et al. 2016, section 4.2, the CIFAR variant).

Three stages of `blocks` basic residual blocks at widths w, 2w, 4w (stride 2 between stages),
global average pooling, a linear head. blocks=5, width=16 is the paper's ResNet-32, the network of
the long-tailed CIFAR anchors (docs/models-and-data.md#on-a-gpu-cifar-10-lt-ratio-100). It takes the
uint8 image ([C, H, W]) the data gives and scales and normalises inside forward, so the served tensor is the compact image. BatchNorm layers
become SyncBatchNorm across ranks on CUDA (the trainer converts any model's BatchNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from training.data_spec import DataSpec


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    mean: torch.Tensor
    std: torch.Tensor

    def __init__(
        self,
        channels: int,
        n_classes: int,
        mean: list[float],
        std: list[float],
        width: int = 32,
        blocks: int = 1,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c = width
        for stage, w in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(BasicBlock(c, w, 2 if stage > 0 and b == 0 else 1))
                c = w
        self.stages = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(c, n_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = (image.float() / 255.0 - self.mean) / self.std
        x = self.stages(self.stem(x))
        return self.head(self.dropout(x.mean(dim=(2, 3))))


def build_cnn(data: DataSpec, width: int = 32, blocks: int = 1, dropout: float = 0.1) -> SmallResNet:
    """The `cnn` factory: one image input [C, H, W] (uint8 from image folders, or float in [0, 255])."""
    if len(data.inputs) != 1 or len(data.inputs[0].shape) != 3 or -1 in data.inputs[0].shape:
        raise ValueError(
            f"the cnn family takes one image input of shape [C, H, W]; this data has "
            f"{[(i.name, list(i.shape)) for i in data.inputs]}"
        )
    channels = data.inputs[0].shape[0]
    mean = data.preprocessing.get("mean") or [0.5] * channels
    std = data.preprocessing.get("std") or [0.25] * channels
    return SmallResNet(channels, data.n_classes, mean, std, width=width, blocks=blocks, dropout=dropout)
