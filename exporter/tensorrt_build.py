"""TensorRT plans from the ONNX graph (GPU machines with the `gpu` extra only).

One optimisation profile over the batch range (min 1, opt, max), FP16 when asked, TF32 off in FP32
plans unless asked (TensorRT enables TF32 by default, which would miss the FP32 parity limit), and a
timing cache kept beside the repository so rebuilds reuse kernel timings. One plan per distinct
compute capability among the visible GPUs (Triton's `cc_model_filenames` picks among them), or one
hardware-compatible plan for every Ampere-or-later GPU. The builder's TensorRT must be the serving
image's (exporter/target.py), or older within the major for version-compatible plans.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from exporter.contract import ServingContract
from exporter.errors import TensorRTUnavailable
from exporter.plans import (
    AMPERE,
    HardwareCompatibility,
    PlanRecord,
    TensorRTBuild,
    capability_tuple,
    plan_filename,
    tensorrt_version_mismatch,
)
from exporter.target import TARGET

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


class TensorRTOptions(BaseModel):
    """Builder options from `skewserve export --trt-...`."""

    version_compatible: bool = False
    hardware_compatibility: HardwareCompatibility = "none"
    tf32: bool = False


def check_builder_version(
    installed: str, opts: TensorRTOptions, target: str = TARGET.tensorrt_version
) -> None:
    """Refuse to build a plan the pinned serving image could not load."""
    reason = tensorrt_version_mismatch(installed, target, opts.version_compatible)
    if reason is not None:
        raise TensorRTUnavailable(
            f"TensorRT {installed} is installed here, but the serving image {TARGET.image} runs TensorRT "
            f"{target}: {reason}"
        )


def visible_capabilities() -> dict[str, tuple[int, str]]:
    """Compute capability ("8.6") -> (first CUDA device index, GPU name) of the visible GPUs."""
    import torch

    found: dict[str, tuple[int, str]] = {}
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        found.setdefault(f"{major}.{minor}", (i, torch.cuda.get_device_name(i)))
    return found


def build_plans(
    onnx_path: Path,
    out_dir: Path,
    contract: ServingContract,
    max_batch: int,
    fp16: bool,
    timing_cache: Path,
    opts: TensorRTOptions,
    check: Callable[[str, bytes], None],
) -> TensorRTBuild:
    """Build the version's plans on this host's GPUs; `check(file, plan)` runs on the plan's GPU."""
    import tensorrt as trt
    import torch

    check_builder_version(trt.__version__, opts)
    gpus = visible_capabilities()
    if opts.hardware_compatibility == "ampere_plus":
        ampere = {cc: dev for cc, dev in gpus.items() if capability_tuple(cc) >= AMPERE}
        if not ampere:
            raise TensorRTUnavailable(
                f"--trt-hardware-compatibility ampere_plus needs an Ampere or later GPU (8.0+); this host has "
                f"compute capability {', '.join(gpus)}"
            )
        gpus = dict([next(iter(ampere.items()))])  # one plan serves every 8.0+ GPU
    several = len(gpus) > 1
    record = TensorRTBuild(
        version=trt.__version__,
        version_compatible=opts.version_compatible,
        hardware_compatibility=opts.hardware_compatibility,
        tf32=opts.tf32 and not fp16,
    )
    for cc, (device, gpu_name) in gpus.items():
        filename = plan_filename(cc, several)
        # TensorRT builds for the current CUDA device: select it for this capability.
        # Kernel timings are per GPU model: one timing cache per capability, so a repository shared
        # by hosts with different GPUs never hands TensorRT a cache measured elsewhere.
        major, minor = capability_tuple(cc)
        cache = timing_cache.with_name(f"{timing_cache.name}.sm{major}{minor}")
        with torch.cuda.device(device):
            plan = build_plan(onnx_path, out_dir / filename, contract, max_batch, fp16, cache, opts)
            check(filename, plan)
        record.plans.append(PlanRecord(file=filename, gpu=gpu_name, compute_capability=cc))
    return record


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    contract: ServingContract,
    max_batch: int,
    fp16: bool,
    timing_cache: Path,
    opts: TensorRTOptions | None = None,
) -> bytes:
    import tensorrt as trt

    opts = opts or TensorRTOptions()
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
    if not opts.tf32:
        # TensorRT sets TF32 by default; FP32 plans must compute in FP32 to meet the 1e-4 parity limit.
        config.clear_flag(trt.BuilderFlag.TF32)
    if opts.version_compatible:
        # Loads on later TensorRT of the same major; Triton must run with
        # --backend-config=tensorrt,version-compatible=true (plans.VERSION_COMPATIBLE_BACKEND_CONFIG).
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if opts.hardware_compatibility == "ampere_plus":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        logger.warning("TensorRT rejected the timing cache %s; building without it", timing_cache)
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(contract, max_batch).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TensorRTUnavailable("TensorRT failed to build the engine; see the TensorRT log above")
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    data = bytes(plan)
    plan_path.write_bytes(data)
    return data


DEFAULT_DYNAMIC_RANGE = (1, 64, 512)


def profile_shapes(
    contract: ServingContract, max_batch: int
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """One optimisation profile (min, opt, max shapes per input, batch included).

    Batch: 1, min(32, max), max. A dynamic dimension takes its (min, opt, max) from the training
    data (the shortest, the median and the longest item, kept in the artifact), so the kernels
    TensorRT picks are timed at the length most requests have.
    """
    opt_batch = max(1, min(max_batch, 32))
    shapes = {}
    for spec in contract.inputs:
        ranges = iter(spec.ranges)
        lo, opt, hi = [1], [opt_batch], [max_batch]
        for d in spec.dims:
            r = next(ranges, DEFAULT_DYNAMIC_RANGE) if d == -1 else (d, d, d)
            lo.append(r[0])
            opt.append(r[1])
            hi.append(r[2])
        shapes[spec.name] = (tuple(lo), tuple(opt), tuple(hi))
    return shapes


def tensorrt_runner(plan: bytes, version_compatible: bool = False) -> Any:
    """Run a plan on the GPU with torch-allocated buffers; returns a parity `Runner`."""
    import tensorrt as trt
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    if version_compatible:
        # A version-compatible plan carries its lean runtime as host code (TensorRT guide).
        runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise TensorRTUnavailable("TensorRT could not deserialize the plan it just built; see its log above")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    torch_dtype = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.uint8: torch.uint8,
        trt.bool: torch.bool,
    }
    input_names = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]

    def run(xs: tuple[np.ndarray, ...]) -> dict[str, np.ndarray]:
        held = []
        for name, x in zip(input_names, xs, strict=True):
            inp = torch.from_numpy(np.ascontiguousarray(x)).cuda()
            held.append(inp)  # alive until the run completes
            context.set_input_shape(name, tuple(inp.shape))
            context.set_tensor_address(name, inp.data_ptr())
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
