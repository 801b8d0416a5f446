"""The serving contract, defined once from the artifact's metadata: tensor names, dtypes and dims.

The ONNX export (input names, dynamic axes), the Triton configs, the local Python-backend runner,
the TensorRT profiles and the parity checks all derive from `ServingContract`, so names and shapes
cannot drift between them. Inputs are the artifact's (any number, any supported dtype, -1 for a
dynamic dimension); outputs are the same for every classifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.data_spec import InputSpec

INPUT_NAME = "features"  # the table family's one input
LOGITS = "logits"
PROBABILITIES = "probabilities"
LABEL = "label"
LABELS_FILE = "labels.txt"
NUMPY_DTYPES = {
    "FP32": "float32",
    "FP16": "float16",
    "INT64": "int64",
    "INT32": "int32",
    "UINT8": "uint8",
    "BOOL": "bool",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    triton_dtype: str  # Triton's wire datatype: FP32, INT64...
    dims: tuple[int, ...]  # per batch item (-1 dynamic); the batch axis is implicit (max_batch_size > 0)
    label_filename: str | None = None
    ranges: tuple[tuple[int, int, int], ...] = ()  # (min, opt, max) per dynamic dim, from training data

    @property
    def numpy_dtype(self) -> str:
        return NUMPY_DTYPES[self.triton_dtype]


@dataclass(frozen=True)
class ServingContract:
    specs: tuple[InputSpec, ...]
    classes: tuple[str, ...]
    # A table's column order: what each position of `features` means (served in the config).
    feature_names: tuple[str, ...] = ()

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ServingContract:
        return cls(
            specs=tuple(InputSpec.from_dict(i) for i in meta["inputs"]),
            classes=tuple(meta["classes"]),
            feature_names=tuple(meta.get("preprocessing", {}).get("feature_names", ())),
        )

    @classmethod
    def table(cls, n_features: int, classes: tuple[str, ...]) -> ServingContract:
        """The table family's contract: one float32 `features` vector."""
        return cls(specs=(InputSpec(INPUT_NAME, "float32", (n_features,)),), classes=classes)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(s.name, s.triton_dtype, s.shape, ranges=s.ranges) for s in self.specs)

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        c = len(self.classes)
        return (
            TensorSpec(LOGITS, "FP32", (c,)),
            TensorSpec(PROBABILITIES, "FP32", (c,), label_filename=LABELS_FILE),
            TensorSpec(LABEL, "INT64", (1,)),
        )

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]
