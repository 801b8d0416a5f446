"""The `text` family: token ids with a padding mask -> a small transformer encoder -> masked mean.

Token id 0 is padding (training.text_preprocess); the mask is derived from it inside forward, so
clients send only token ids, of any length up to the longest seen in training. Attention is written
out (softmax(QK^T / sqrt(d) + mask) V, Vaswani et al. 2017, eq. 1) rather than through
nn.TransformerEncoder, whose inference fast path turns padded batches into nested tensors that
neither ONNX nor TorchScript tracing can follow.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from training.data_spec import DataSpec


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + bias
        att = torch.softmax(scores, dim=-1) @ v
        x = x + self.dropout(self.proj(att.transpose(1, 2).reshape(b, n, d)))
        return x + self.dropout(self.ff(self.norm2(x)))


class TextClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        n_classes: int,
        dim: int,
        heads: int,
        layers: int,
        ff: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.position = nn.Embedding(max_length, dim)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, ff, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.long()
        keep = (tokens != 0).unsqueeze(-1).float()  # [b, n, 1]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions).unsqueeze(0)
        # Padding keys get -1e4 (not -inf): an all-padding row stays finite in FP16 as well.
        bias = ((1.0 - keep.squeeze(-1)) * -1e4).unsqueeze(1).unsqueeze(1)
        for block in self.blocks:
            x = block(x, bias)
        x = self.norm(x)
        pooled = (x * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


def build_text(
    data: DataSpec, dim: int = 64, heads: int = 4, layers: int = 2, ff: int = 128, dropout: float = 0.1
) -> TextClassifier:
    """The `text` factory: one integer input of dynamic length (token ids, 0 = padding)."""
    ints = [i for i in data.inputs if i.dtype in ("int64", "int32") and i.shape == (-1,)]
    if len(data.inputs) != 1 or not ints:
        raise ValueError(
            f"the text family takes one input of token ids, shape [-1] (int64 or int32); this data has "
            f"{[(i.name, i.dtype, list(i.shape)) for i in data.inputs]}"
        )
    if dim % heads:
        raise ValueError(f"text: dim ({dim}) must be a multiple of heads ({heads})")
    spec = ints[0]
    pre = data.preprocessing
    vocab_size = len(pre["vocab"]) + 2 if "vocab" in pre else int(pre.get("max_id", {}).get(spec.name, 0)) + 1
    max_length = int(pre.get("max_length") or (spec.ranges[0][2] if spec.ranges else 512))
    return TextClassifier(max(vocab_size, 2), max_length, data.n_classes, dim, heads, layers, ff, dropout)
