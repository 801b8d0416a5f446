"""The serving contract, defined once from the artifact's metadata: tensor names, dtypes and dims.

The ONNX export, the Triton configs, the local Python-backend runner and the parity checks all
derive from `ServingContract`, so names and shapes cannot drift between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INPUT_NAME = "features"
LOGITS = "logits"
PROBABILITIES = "probabilities"
LABEL = "label"
LABELS_FILE = "labels.txt"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    triton_dtype: str  # Triton's wire datatype: FP32, INT64...
    dims: tuple[int, ...]  # per batch item; the batch axis is implicit (max_batch_size > 0)
    label_filename: str | None = None

    @property
    def numpy_dtype(self) -> str:
        return {"FP32": "float32", "FP16": "float16", "INT64": "int64"}[self.triton_dtype]


@dataclass(frozen=True)
class ServingContract:
    n_features: int
    classes: tuple[str, ...]
    feature_names: tuple[str, ...]

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ServingContract:
        inputs = meta["inputs"]
        bad = [i["name"] for i in inputs if i.get("dtype") != "float32"]
        if bad:
            raise ValueError(
                f"artifact inputs {bad} are not float32; the serving graph takes float32 features"
            )
        return cls(
            n_features=len(inputs),
            classes=tuple(meta["classes"]),
            feature_names=tuple(i["name"] for i in inputs),
        )

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec(INPUT_NAME, "FP32", (self.n_features,)),)

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
