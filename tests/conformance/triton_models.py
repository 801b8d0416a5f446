"""Python-backend versions of the models Triton's client examples call (the originals are C++
custom backends and ONNX files in Triton's qa), with the same names, tensors and answers:

- `simple`: INPUT0, INPUT1 INT32 [16] -> OUTPUT0 = their sum, OUTPUT1 = their difference.
- `simple_string`: the same over decimal strings (BYTES).
- `simple_identity`: BYTES INPUT0 -> OUTPUT0 unchanged.
- `simple_sequence` (sequence batching, direct, START and READY controls, up to 8 live
  sequences, integer or string correlation ids): OUTPUT = INPUT + 1 on a sequence's first
  request, INPUT after, as the examples expect of Triton's qa `sequence` backend.
"""

from __future__ import annotations

from pathlib import Path

from tests.gateway.protocol_models import python_model_repo

_HEADER = """
import numpy as np
import triton_python_backend_utils as pb_utils


def tensor(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()
"""

SIMPLE = (
    """
name: "simple"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
""",
    _HEADER
    + """

class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for r in requests:
            a, b = tensor(r, "INPUT0"), tensor(r, "INPUT1")
            answers.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", (a + b).astype(np.int32)), pb_utils.Tensor("OUTPUT1", (a - b).astype(np.int32))]
            ))
        return answers
""",
)

SIMPLE_STRING = (
    """
name: "simple_string"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
""",
    _HEADER
    + """

def numbers(array):
    return np.vectorize(lambda v: int(v.decode() if isinstance(v, bytes) else v))(array)


def strings(array):
    return np.vectorize(lambda v: str(v).encode(), otypes=[np.object_])(array)


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for r in requests:
            a, b = numbers(tensor(r, "INPUT0")), numbers(tensor(r, "INPUT1"))
            answers.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", strings(a + b)), pb_utils.Tensor("OUTPUT1", strings(a - b))]
            ))
        return answers
""",
)

SIMPLE_IDENTITY = (
    """
name: "simple_identity"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
""",
    _HEADER
    + """

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", tensor(r, "INPUT0"))]) for r in requests]
""",
)

SIMPLE_SEQUENCE = (
    """
name: "simple_sequence"
backend: "python"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
""",
    _HEADER
    + """

class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for r in requests:
            start = tensor(r, "START").astype(np.int32)
            answers.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", (tensor(r, "INPUT") + start).astype(np.int32))]
            ))
        return answers
""",
)

MODELS = {
    "simple": SIMPLE,
    "simple_string": SIMPLE_STRING,
    "simple_identity": SIMPLE_IDENTITY,
    "simple_sequence": SIMPLE_SEQUENCE,
}


def example_repo(dest: Path) -> Path:
    """A model repository with the models above."""
    return python_model_repo(dest, MODELS)
