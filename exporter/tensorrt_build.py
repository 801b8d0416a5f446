"""TensorRT plan from the ONNX graph (GPU machines with the `gpu` extra only).

One optimisation profile over the batch range (min 1, opt, max), FP16 when asked, and a timing
cache kept beside the repository so rebuilds reuse kernel timings.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from exporter.contract import INPUT_NAME
from exporter.errors import TensorRTUnavailable

logger = logging.getLogger(__name__)


def tensorrt_unavailable_reason() -> str | None:
    """None when a plan can be built here; otherwise why not, in one line."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU on this machine"
    except ImportError:
        return "torch is not installed"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt package is not installed (pip install 'skewserve[gpu]')"
    return None


def resolve_mode(mode: str) -> bool:
    """auto: build when possible, else a one-line notice; on: build or fail; off: never."""
    if mode not in {"auto", "on", "off"}:
        raise ValueError(f"--tensorrt must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False
    reason = tensorrt_unavailable_reason()
    if reason is None:
        return True
    if mode == "on":
        raise TensorRTUnavailable(f"--tensorrt on, but {reason}; use --tensorrt auto or off on this machine")
    logger.warning("TensorRT plan skipped: %s (--tensorrt auto)", reason)
    return False


def build_plan(
    onnx_path: Path, plan_path: Path, n_features: int, max_batch: int, fp16: bool, timing_cache: Path
) -> bytes:
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TensorRTUnavailable(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    opt = max(1, min(max_batch, 32))
    profile.set_shape(INPUT_NAME, (1, n_features), (opt, n_features), (max_batch, n_features))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TensorRTUnavailable("TensorRT failed to build the engine; see the TensorRT log above")
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    data = bytes(plan)
    plan_path.write_bytes(data)
    return data


def tensorrt_runner(plan: bytes) -> Any:
    """Run a plan on the GPU with torch-allocated buffers; returns a parity `Runner`."""
    import tensorrt as trt
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    torch_dtype = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
    }

    def run(x: np.ndarray) -> dict[str, np.ndarray]:
        inp = torch.from_numpy(x).cuda()
        context.set_input_shape(INPUT_NAME, tuple(inp.shape))
        context.set_tensor_address(INPUT_NAME, inp.data_ptr())
        bufs = {}
        for name in outputs:
            shape = tuple(context.get_tensor_shape(name))
            bufs[name] = torch.empty(shape, dtype=torch_dtype[engine.get_tensor_dtype(name)], device="cuda")
            context.set_tensor_address(name, bufs[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return {n: b.cpu().numpy() for n, b in bufs.items()}

    return run
