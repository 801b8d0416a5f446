"""Export the serving module to ONNX (pinned opset, dynamic batch), and an FP16 variant."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections import deque
from pathlib import Path

import onnx
import torch

from exporter.contract import INPUT_NAME, ServingContract
from exporter.graph import ServingModule

logger = logging.getLogger(__name__)
OPSET = 18


def export_onnx(
    module: ServingModule, contract: ServingContract, path: Path, max_batch: int
) -> onnx.ModelProto:
    """Export with torch.export (PyTorch's supported ONNX path); onnx.checker must pass."""
    example = torch.zeros(2, contract.n_features)
    batch = torch.export.Dim("batch", min=1, max=max(2, max_batch))
    # The exporter narrates progress on stdout and warns about optional torchvision ops and its own
    # deprecations; none of it concerns this graph, so keep it off the CLI's output.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\..*|copyreg")
        program = torch.onnx.export(
            module,
            (example,),
            dynamo=True,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=contract.output_names,
            dynamic_shapes=({0: batch},),
            verbose=False,
            report=False,
        )
    assert program is not None
    model = program.model_proto
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return model


def topological_sort(graph: onnx.GraphProto) -> None:
    """Reorder nodes so every input is produced before use (ORT's float16 pass can break this)."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    nodes = list(graph.node)
    producers: dict[str, int] = {out: i for i, n in enumerate(nodes) for out in n.output}
    waiting = [sum(1 for x in n.input if x not in available and x in producers) for n in nodes]
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            if x not in available and x in producers:
                consumers.setdefault(x, []).append(i)
    ready = deque(i for i, w in enumerate(waiting) if w == 0)
    order: list[int] = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for out in nodes[i].output:
            for j in consumers.get(out, []):
                waiting[j] -= 1
                if waiting[j] == 0:
                    ready.append(j)
    if len(order) != len(nodes):
        raise ValueError("ONNX graph has a cycle; cannot order its nodes")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def convert_fp16(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """FP16 weights and compute, FP32 at the boundary so clients and configs stay unchanged."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # Softmax and ArgMax stay FP32: the probabilities must sum to 1 and ties must break as in FP32.
    half = convert_float_to_float16(model, keep_io_types=True, op_block_list=["Softmax", "ArgMax"])
    topological_sort(half.graph)
    onnx.checker.check_model(half, full_check=True)
    onnx.save(half, str(path))
    return half
