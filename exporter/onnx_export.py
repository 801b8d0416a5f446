"""Export the serving module to ONNX (pinned opset, dynamic batch), and an FP16 variant."""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import warnings
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from exporter.contract import ServingContract
from exporter.errors import ExportError
from exporter.graph import ServingModule

logger = logging.getLogger(__name__)
OPSET = 18


def dynamic_shapes(contract: ServingContract, max_batch: int) -> tuple[dict[int, Any], ...]:
    """torch.export dims per input: the batch axis, and every -1 of the contract up to its longest."""
    batch = torch.export.Dim("batch", min=1, max=max(2, max_batch))
    out = []
    for spec in contract.inputs:
        axes: dict[int, Any] = {0: batch}
        ranges = iter(spec.ranges)
        for axis, d in enumerate(spec.dims, start=1):
            if d == -1:
                top = next(ranges, (1, 1, 4096))[2]
                axes[axis] = torch.export.Dim(f"{spec.name}_{axis}", min=1, max=max(2, top))
        out.append(axes)
    return tuple(out)


class _TorchlibRegistries:
    """torch.onnx's tables of ATen -> ONNX functions, built once per process and opset.

    torch.onnx.export rebuilds its table on every call by re-reading the source of about 500
    onnxscript functions: about 1 s of the 2 s a small model's second export in one process takes.
    While any export of this module runs, `ONNXRegistry.from_torchlib` hands out a copy of the table
    built the first time (its function lists copied, so a caller's own translation table, which torch
    adds to the registry, stays in that caller's copy); the last export to end puts torch's own
    method back. A torch without this internal exports as it is.
    """

    def __init__(self) -> None:
        self.built: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._active = 0
        self._original: Any = None

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        registry_class = self._registry_class()
        if registry_class is None:
            yield
            return
        with self._lock:
            if self._active == 0:
                self._original = registry_class.__dict__["from_torchlib"]
                registry_class.from_torchlib = classmethod(self._copy_of)
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    registry_class.from_torchlib = self._original

    @staticmethod
    def _registry_class() -> Any:
        try:
            from torch.onnx._internal.exporter import _registration
        except ImportError:
            return None
        registry_class = _registration.ONNXRegistry
        original = registry_class.__dict__.get("from_torchlib")
        return registry_class if isinstance(original, classmethod) else None

    def _copy_of(self, cls: Any, opset_version: int | None = None) -> Any:
        from torch.onnx._internal.exporter import _constants

        opset = _constants.TORCHLIB_OPSET if opset_version is None else opset_version
        with self._lock:
            built = self.built.get(opset)
            if built is None:
                built = self.built[opset] = self._original.__func__(cls, opset_version=opset)
        registry = cls()
        registry._opset_version = built._opset_version
        registry.functions = {op: list(metas) for op, metas in built.functions.items()}
        return registry


_TORCHLIB_REGISTRIES = _TorchlibRegistries()


def export_onnx(
    module: ServingModule,
    contract: ServingContract,
    path: Path,
    max_batch: int,
    example: tuple[np.ndarray, ...],
    model_name: str = "the model",
) -> onnx.ModelProto:
    """Export with torch.export (PyTorch's supported ONNX path) on a real batch; onnx.checker must pass.

    A model torch.export cannot trace (data-dependent control flow, an operator without an ONNX
    lowering) is refused with the operator or line named and the TorchScript route suggested.
    """
    args = tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in example)
    # The exporter narrates progress on stdout and warns about optional torchvision ops and its own
    # deprecations; none of it concerns this graph, so keep it off the CLI's output.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
            _TORCHLIB_REGISTRIES.in_use(),
        ):
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\..*|copyreg")
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=contract.input_names,
                output_names=contract.output_names,
                dynamic_shapes=dynamic_shapes(contract, max_batch),
                verbose=False,
                report=False,
            )
    except Exception as exc:
        detail = " ".join(str(exc).split())[:600]
        raise ExportError(
            f"{model_name} cannot be exported to ONNX: {type(exc).__name__}: {detail}. If an operator or "
            "data-dependent branch is named, rewrite it, or export with --format torchscript (traced, "
            "served by Triton's libtorch backend)"
        ) from exc
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


def quantize_int8(fp32_path: Path, path: Path, calibration: list[tuple[np.ndarray, ...]]) -> onnx.ModelProto:
    """Static INT8 (QDQ, signed activations and per-channel weights) calibrated on real batches.

    Static, not dynamic: dynamic quantization scales activations by each batch's range, so a row's
    answer would depend on which requests Triton batched it with. S8S8 in QDQ format is ONNX
    Runtime's recommended CPU default (its quantization guide: U8S8 can saturate on AVX2 without VNNI).
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    names = [i.name for i in onnx.load(str(fp32_path), load_external_data=False).graph.input]

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            self.feed = iter([dict(zip(names, b, strict=True)) for b in calibration])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feed, None)

    try:
        quantize_static(
            str(fp32_path),
            str(path),
            Batches(),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            # The weight-heavy ops only: Softmax and ArgMax stay FP32, so probabilities sum to 1 and
            # are not rounded to steps of 1/255.
            op_types_to_quantize=["Conv", "MatMul", "Gemm"],
        )
    except Exception as exc:
        raise ExportError(
            f"INT8 quantization failed: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}; "
            "export --precision fp32 or fp16"
        ) from exc
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    return model
