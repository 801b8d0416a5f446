"""The serving module: the model's inputs in; logits, softmax probabilities and arg-max label out."""

from __future__ import annotations

import keyword

import torch
from torch import nn


class ServingModule(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.eval()  # serving never runs dropout or input noise; BatchNorm uses its running stats

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Preprocessing that belongs to the model (standardisation, pixel scaling) runs inside it.
        logits = self.model(*inputs).float()
        return logits, torch.softmax(logits, dim=1), torch.argmax(logits, dim=1, keepdim=True)


def serving_module(model: nn.Module, input_names: list[str]) -> ServingModule:
    """A ServingModule whose forward names its arguments after the contract's inputs.

    Triton's libtorch backend matches config inputs to `forward`'s argument names, which a trace
    keeps; a `*inputs` signature would leave it only the order. Names that are not Python
    identifiers keep the positional form (the backend then maps by order).
    """
    if not all(n.isidentifier() and not keyword.iskeyword(n) and n != "self" for n in input_names):
        return ServingModule(model)
    args = ", ".join(input_names)
    namespace: dict[str, object] = {}
    exec(
        f"def forward(self, {args}):\n    return ServingModule.forward(self, {args})\n",
        {"ServingModule": ServingModule},
        namespace,
    )  # noqa: S102 - names checked above
    cls = type("NamedServingModule", (ServingModule,), {"forward": namespace["forward"]})
    module: ServingModule = cls(model)
    return module
