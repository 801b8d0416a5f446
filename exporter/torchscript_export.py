"""TorchScript export of the serving module, for Triton's libtorch backend (`pytorch_libtorch`).

Traced, not scripted: the serving graph has no data-dependent control flow, and tracing keeps the
module's positional inputs in the contract's order, which is how Triton's libtorch backend maps
the config's inputs. Outputs carry no names in TorchScript; our output names do not follow the
backend's `<name>__<index>` convention, so it maps them by order (logits, probabilities, label),
which is the tuple order of `ServingModule.forward`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from exporter.graph import ServingModule


def export_torchscript(module: ServingModule, examples: list[tuple[np.ndarray, ...]], path: Path) -> None:
    """Trace on real batches of several sizes (the trace checker re-runs the others) and save `model.pt`."""
    tensors = [tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in batch) for batch in examples]
    with torch.no_grad(), warnings.catch_warnings():
        # torch.jit is in maintenance mode and says so; the libtorch backend still loads TorchScript only.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        traced = torch.jit.trace(module, tensors[0], check_inputs=tensors[1:] or None)
    traced.save(str(path))
