"""TorchScript export of the serving module, for Triton's libtorch backend (`pytorch_libtorch`).

Traced, not scripted: the serving graph has no data-dependent control flow, and tracing keeps the
module's `forward(features)` signature, whose argument name Triton's libtorch backend matches to the
config's input `features`. Outputs carry no names in TorchScript; our output names do not follow the
backend's `<name>__<index>` convention, so it maps them by order (logits, probabilities, label),
which is the tuple order of `ServingModule.forward`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from exporter.contract import ServingContract
from exporter.graph import ServingModule


def export_torchscript(module: ServingModule, contract: ServingContract, path: Path) -> None:
    """Trace on several batch sizes (the trace checker re-runs them) and save `model.pt`."""
    n = contract.n_features
    generator = torch.Generator().manual_seed(0)
    examples = [(torch.randn(b, n, generator=generator),) for b in (2, 1, 7)]
    with torch.no_grad(), warnings.catch_warnings():
        # torch.jit is in maintenance mode and says so; the libtorch backend still loads TorchScript only.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        traced = torch.jit.trace(module, examples[0], check_inputs=examples[1:])
    traced.save(str(path))
