"""Shape-grouped local batching (exporter/local_batching.py, copied beside the local runners as
`batching.py`) in a real tritonserver: requests of different shapes handed to one `execute` call
are run in groups of equal per-item shapes, and each request's answer equals the answer it gets
alone.

Triton batches requests of different shapes together only for inputs with `allow_ragged_batch`, so
the batched model allows it, and its dynamic batcher waits (bounded) for all seven items of the
four requests: the model's statistics show one execution for them."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from numpy.testing import assert_array_equal

from exporter.pipeline import LOCAL_BATCHING
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from tests.waiting import wait_until

# Per item: a running sum over the row and the row's mean, so an item run with another's row, a
# padded row or a row split at the wrong place gives another answer.
MODEL_PY = """
import os
import sys

import numpy as np


class TritonPythonModel:
    def initialize(self, args):
        sys.path.insert(0, os.path.join(args["model_repository"], args["model_version"]))
        from batching import run_grouped

        self.run_grouped = run_grouped

    def execute(self, requests):
        def run(batch):
            (x,) = batch
            return [(np.cumsum(x, axis=1) * 2.0 + x.mean(axis=1, keepdims=True)).astype(np.float32)]

        return self.run_grouped(requests, ["X"], ["Y"], run)
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] {ragged} }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{batching}
"""

# Four requests, two per-item shapes, seven items: one batch at the preferred size.
SHAPES = [(2, 3), (1, 5), (3, 3), (1, 5)]
BATCHED = "dynamic_batching { preferred_batch_size: [ 7 ] max_queue_delay_microseconds: 120000000 }"


def _write(repo: Path, name: str, batched: bool) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(MODEL_PY)
    shutil.copy2(LOCAL_BATCHING, repo / name / "1" / "batching.py")
    (repo / name / "config.pbtxt").write_text(
        CONFIG.format(
            name=name,
            ragged="allow_ragged_batch: true" if batched else "",
            batching=BATCHED if batched else "",
        )
    )


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[TritonServer]:
    repo = tmp_path_factory.mktemp("batching_repo")
    _write(repo, "grouped", batched=True)
    _write(repo, "alone", batched=False)
    triton = TritonServer(
        TritonServerSpec(repository=repo, name="batching", model_config_name=None),
        tmp_path_factory.mktemp("logs"),
        prepared_triton,
    )
    with triton:
        yield triton


def _infer(server: TritonServer, model: str, x: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=180)
    try:
        inp = httpclient.InferInput("X", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        y = client.infer(model, [inp]).as_numpy("Y")
        assert y is not None
        return y
    finally:
        client.close()


def _stats(server: TritonServer, model: str) -> tuple[int, int]:
    """(inference_count, execution_count): items served, and `execute` calls that served them."""
    with urllib.request.urlopen(f"http://{server.http_address}/v2/models/{model}/stats", timeout=30) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_mixed_shapes_in_one_call_are_grouped_and_answer_as_alone(server: TritonServer) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    alone = [_infer(server, "alone", x) for x in xs]
    for x, y in zip(xs, alone, strict=True):  # what the model computes, one request at a time
        assert_array_equal(y, (np.cumsum(x, axis=1) * 2.0 + x.mean(axis=1, keepdims=True)).astype(np.float32))

    before = _stats(server, "grouped")
    answers: dict[int, np.ndarray] = {}
    clients = [
        threading.Thread(target=lambda i=i: answers.__setitem__(i, _infer(server, "grouped", xs[i])))
        for i in range(len(xs))
    ]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    # Triton records a batch's statistics after it has sent the batch's answers: wait for them
    wait_until(lambda: _stats(server, "grouped")[0] - before[0] >= 7, 30, "the seven items counted")
    inferences, executions = _stats(server, "grouped")
    # all four requests (seven items) in one execute call: mixed shapes there together
    assert (inferences - before[0], executions - before[1]) == (7, 1)
    for i, y in enumerate(alone):
        assert answers[i].shape == y.shape
        assert_array_equal(answers[i], y)
