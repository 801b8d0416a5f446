"""Python-backend models for the protocol tests: what Triton's own streaming and generate tests call.

- `repeat_int32` (decoupled): one response per element of IN (OUT = the element, IDX = its index),
  then the final flag; with WAIT (a file path) each response after the first waits for that file,
  so a test decides when a stream moves on (a held stream) without sleeping.
- `seq_sum` (sequence batching, direct, up to 8 live sequences): OUTPUT = the running sum of INPUT
  ([1, 1]) over the sequence, keyed by the correlation id Triton hands it (CORRID), reset at START.
- `mock_llm` (decoupled, the generate extension's shape): text_output is text_input's words, one
  response per word when `stream` is true, else one response with all of them; with `release`
  (a file path) every word after the first waits for that file.
"""

from __future__ import annotations

from pathlib import Path

REPEAT_CONFIG = """
name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

WAIT_FOR_FILE = """
import os
import threading
import time


def wait_for(path, limit_s=120.0):
    # A test's signal to go on: the file appears. Bounded, so a forgotten stream still ends.
    end = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)
"""

REPEAT_PY = (
    WAIT_FOR_FILE
    + """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._answer, args=(request,), daemon=True).start()
        return None

    def _answer(self, request):
        sender = request.get_response_sender()
        values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        wait = pb_utils.get_input_tensor_by_name(request, "WAIT")
        path = None if wait is None else wait.as_numpy().ravel()[0].decode()
        for i, value in enumerate(values.ravel()):
            if i and path:
                wait_for(path)
            sender.send(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                        pb_utils.Tensor("IDX", np.array([i], dtype=np.uint32)),
                    ]
                )
            )
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
)

SEQ_CONFIG = """
name: "seq_sum"
backend: "python"
# The direct scheduler holds one slot per batch row for each live sequence: 8 sequences at once.
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

SEQ_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy().ravel()[0])
            corrid = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().ravel()[0])
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().ravel()[0])
            total = (0 if start else self.sums.get(corrid, 0)) + value
            self.sums[corrid] = total
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array([[total]], dtype=np.int32))])
            )
        return responses
"""

LLM_CONFIG = """
name: "mock_llm"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "release" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

LLM_PY = (
    WAIT_FOR_FILE
    + """
import numpy as np
import triton_python_backend_utils as pb_utils


def text(value):
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor("text_output", np.array([value.encode()], dtype=np.object_))]
    )


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._answer, args=(request,), daemon=True).start()
        return None

    def _answer(self, request):
        sender = request.get_response_sender()
        words = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().ravel()[0].decode().split()
        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        release = pb_utils.get_input_tensor_by_name(request, "release")
        path = None if release is None else release.as_numpy().ravel()[0].decode()
        if stream is not None and bool(stream.as_numpy().ravel()[0]):
            for i, word in enumerate(words):
                if i and path:
                    wait_for(path)
                sender.send(text(word))
        else:
            sender.send(text(" ".join(words)))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
)

MODELS = {
    "repeat_int32": (REPEAT_CONFIG, REPEAT_PY),
    "seq_sum": (SEQ_CONFIG, SEQ_PY),
    "mock_llm": (LLM_CONFIG, LLM_PY),
}


def protocol_repo(dest: Path) -> Path:
    """A model repository with the models above (config.pbtxt and the local config variant)."""
    return python_model_repo(dest, MODELS)


def python_model_repo(dest: Path, models: dict[str, tuple[str, str]]) -> Path:
    """Python-backend models (name -> (config, model.py)) written as a repository, each config as
    config.pbtxt and as the local variant the test Tritons read (configs/local.pbtxt)."""
    for name, (config, code) in models.items():
        (dest / name / "1").mkdir(parents=True)
        (dest / name / "1" / "model.py").write_text(code)
        (dest / name / "configs").mkdir()
        for path in (dest / name / "config.pbtxt", dest / name / "configs" / "local.pbtxt"):
            path.write_text(config)
    return dest
