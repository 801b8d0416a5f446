"""What a model factory is told about the data: input tensors, classes and preprocessing.

Defined once here and stored in the artifact; the exporter derives ONNX names, dynamic axes and
Triton configs from the same record, so the training and serving contracts cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# numpy dtype name -> Triton wire datatype. These are the dtypes an input may have end to end.
TRITON_DTYPES = {
    "float32": "FP32",
    "float16": "FP16",
    "int64": "INT64",
    "int32": "INT32",
    "uint8": "UINT8",
    "bool": "BOOL",
}
DYNAMIC = -1


@dataclass(frozen=True)
class InputSpec:
    """One input tensor: name, numpy dtype and per-item shape (-1 marks a dynamic dimension)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    # Per dynamic dimension (in order): (min, opt, max) seen in the training data; TensorRT profiles.
    ranges: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in TRITON_DTYPES:
            raise ValueError(
                f"input {self.name!r} has dtype {self.dtype}; supported: {', '.join(TRITON_DTYPES)}"
            )
        if any(d != DYNAMIC and d < 1 for d in self.shape):
            raise ValueError(
                f"input {self.name!r} has shape {list(self.shape)}: dims are >= 1 or -1 (dynamic)"
            )

    @property
    def dynamic_axes(self) -> list[int]:
        """Axes of the batched tensor (batch is axis 0) whose size varies."""
        return [i + 1 for i, d in enumerate(self.shape) if d == DYNAMIC]

    @property
    def triton_dtype(self) -> str:
        return TRITON_DTYPES[self.dtype]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.ranges:
            out["ranges"] = [list(r) for r in self.ranges]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InputSpec:
        return cls(
            name=str(d["name"]),
            dtype=str(d["dtype"]),
            shape=tuple(int(x) for x in d["shape"]),
            ranges=tuple(tuple(int(v) for v in r) for r in d.get("ranges", ())),  # type: ignore[misc]
        )


@dataclass(frozen=True)
class DataSpec:
    """The description a factory receives: `forward(*inputs)` takes the inputs in this order."""

    kind: str  # table | images | tensors
    inputs: tuple[InputSpec, ...]
    classes: tuple[str, ...]
    class_counts: tuple[int, ...]
    preprocessing: dict[str, Any] = field(default_factory=dict)

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    @property
    def n_train(self) -> int:
        return int(sum(self.class_counts))

    @property
    def class_priors(self) -> np.ndarray:
        counts = np.asarray(self.class_counts, dtype=np.float64)
        return counts / counts.sum()

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "inputs": [i.as_dict() for i in self.inputs],
            "classes": list(self.classes),
            "class_counts": list(self.class_counts),
            "preprocessing": self.preprocessing,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataSpec:
        return cls(
            kind=str(d["kind"]),
            inputs=tuple(InputSpec.from_dict(i) for i in d["inputs"]),
            classes=tuple(str(c) for c in d["classes"]),
            class_counts=tuple(int(c) for c in d["class_counts"]),
            preprocessing=dict(d.get("preprocessing", {})),
        )
