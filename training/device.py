"""Where a rank runs and in which precision, decided once from the launcher's environment.

`plan_placement` is a pure function of (environment, what the host offers, what the config asks):
it returns a typed `Placement` that the worker then applies (set_device, DDP device_ids, backend,
autocast, gradient scaler). Keeping the decision pure is what lets every branch be tested on a
CPU-only machine; `host_capabilities` is the one place that asks torch what the host has.

Step timing has one interface, `StepClock`, and two implementations: wall time on the CPU, CUDA
events on a GPU. On CUDA, kernels run asynchronously to the Python thread, so host timestamps around
`backward()` measure kernel launches, not compute; events recorded on the stream measure when the
device actually reached each point (CUDA C Programming Guide, "Events").
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from training.errors import ConfigError

DeviceChoice = Literal["auto", "cpu", "cuda"]
PrecisionChoice = Literal["auto", "fp32", "bf16", "fp16"]
Precision = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class HostCapabilities:
    """What the host offers, as seen by this process (CUDA_VISIBLE_DEVICES already applied)."""

    cuda_available: bool
    cuda_device_count: int = 0
    bf16_supported: bool = False


@dataclass(frozen=True)
class Placement:
    """The resolved plan for one rank: device, collective backend and mixed precision."""

    device_type: Literal["cpu", "cuda"]
    device_index: int | None  # the CUDA ordinal (LOCAL_RANK); None on the CPU
    local_rank: int
    backend: Literal["nccl", "gloo"]
    precision: Precision  # what is actually used, recorded in the artifact's provenance
    autocast_dtype: torch.dtype | None  # None: autocast disabled
    grad_scaler: bool  # fp16 needs loss scaling; bf16 has fp32's exponent range and does not
    pin_memory: bool  # page-locked host batches make non_blocking host->device copies asynchronous

    @property
    def device(self) -> torch.device:
        if self.device_index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, self.device_index)

    @property
    def ddp_device_ids(self) -> list[int] | None:
        """DDP's device_ids: the one GPU of this rank on CUDA, None for CPU modules."""
        return [self.device_index] if self.device_index is not None else None


def host_capabilities() -> HostCapabilities:
    """Ask torch what this process can use."""
    if not torch.cuda.is_available():
        return HostCapabilities(cuda_available=False)
    return HostCapabilities(
        cuda_available=True,
        cuda_device_count=torch.cuda.device_count(),
        bf16_supported=bool(torch.cuda.is_bf16_supported()),
    )


def plan_placement(
    env: Mapping[str, str],
    host: HostCapabilities,
    precision: PrecisionChoice = "auto",
    device: DeviceChoice = "auto",
) -> Placement:
    """Map (launcher env, host, requested precision and device) to a placement; refuse contradictions.

    torchrun sets LOCAL_RANK per worker on each node; rank i of a node uses GPU i, the layout NCCL
    expects (one GPU per process). `auto` precision is bf16 on GPUs that support it, else fp16 with a
    gradient scaler, and fp32 on the CPU (CPU autocast is slower than fp32 for these small models).
    """
    raw = env.get("LOCAL_RANK", "0")
    try:
        local_rank = int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={raw!r} is not an integer; launch workers with torchrun") from None
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK={local_rank} is negative; launch workers with torchrun")
    if device == "cuda" and not host.cuda_available:
        raise ConfigError("device cuda was asked for but torch sees no CUDA GPU; use --device cpu or auto")
    use_cuda = host.cuda_available and device != "cpu"
    if use_cuda and local_rank >= host.cuda_device_count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this node has {host.cuda_device_count} visible CUDA GPU(s); "
            f"lower --nproc to at most {host.cuda_device_count} per node or use --device cpu"
        )
    if precision == "fp16" and not use_cuda:
        raise ConfigError("precision fp16 needs a CUDA GPU (use bf16 on CPU)")
    if precision == "bf16" and use_cuda and not host.bf16_supported:
        raise ConfigError("precision bf16 is not supported by this GPU; use --precision fp16 or auto")
    resolved: Precision
    if precision == "auto":
        resolved = ("bf16" if host.bf16_supported else "fp16") if use_cuda else "fp32"
    else:
        resolved = precision
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[resolved]
    return Placement(
        device_type="cuda" if use_cuda else "cpu",
        device_index=local_rank if use_cuda else None,
        local_rank=local_rank,
        backend="nccl" if use_cuda else "gloo",
        precision=resolved,
        autocast_dtype=dtype,
        grad_scaler=resolved == "fp16",
        pin_memory=use_cuda,
    )


def activate(placement: Placement) -> None:
    """Bind this process to its GPU before any CUDA work (NCCL and DDP use the current device)."""
    if placement.device_index is not None:
        torch.cuda.set_device(placement.device_index)


def autocast(placement: Placement) -> Any:
    """The autocast context of the plan; a no-op context in fp32."""
    if placement.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=placement.device_type, dtype=placement.autocast_dtype)


def grad_scaler(placement: Placement) -> torch.amp.GradScaler:
    """fp16 gradient scaler on the plan's device; disabled (a pass-through) otherwise."""
    return torch.amp.GradScaler(placement.device_type, enabled=placement.grad_scaler)


def gather_batch(source: torch.Tensor, index: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Rows `index` of a host tensor, on the plan's device.

    On CUDA the rows are gathered straight into page-locked memory (torch's caching host allocator
    reuses it safely across steps), so the host-to-device copy runs asynchronously (non_blocking)
    without pinning the whole data set.
    """
    if placement.device_type == "cpu":
        return source.index_select(0, index)
    staged = torch.empty((len(index), *source.shape[1:]), dtype=source.dtype, pin_memory=placement.pin_memory)
    torch.index_select(source, 0, index, out=staged)
    return staged.to(placement.device, non_blocking=True)


def to_device(batch: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Move a batch to the plan's device; asynchronous from pinned memory on CUDA."""
    if placement.device_type == "cpu":
        return batch
    if placement.pin_memory and not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(placement.device, non_blocking=True)


# -- step timing -----------------------------------------------------------------------------------


class StepClock(ABC):
    """Named time points within one training step; durations between them in seconds.

    `mark` is cheap and never waits. `seconds` may wait for the device to reach the later point
    (CUDA), so read durations once per step, after the optimizer step has been issued.
    """

    @abstractmethod
    def start(self) -> None:
        """Begin a step: forget the previous step's points and mark `start`."""

    @abstractmethod
    def mark(self, name: str) -> None:
        """Record the point `name` (on the device's stream where there is one)."""

    @abstractmethod
    def seconds(self, a: str, b: str) -> float:
        """Seconds from point a to point b of the current step."""

    @abstractmethod
    def since(self, name: str) -> float:
        """Seconds from point `name` to now, the device having caught up (synchronises on CUDA)."""


class WallClock(StepClock):
    """CPU ranks: compute happens on the calling thread, so a monotonic clock measures it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._points: dict[str, float] = {}

    def start(self) -> None:
        self._points = {}
        self.mark("start")

    def mark(self, name: str) -> None:
        self._points[name] = self._clock()

    def seconds(self, a: str, b: str) -> float:
        return self._points[b] - self._points[a]

    def since(self, name: str) -> float:
        return self._clock() - self._points[name]


class CudaEventClock(StepClock):
    """GPU ranks: CUDA events recorded on the current stream; elapsed_time reads device time."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._events: dict[str, torch.cuda.Event] = {}

    def start(self) -> None:
        self._events = {}
        self.mark("start")

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        self._events[name] = event

    def seconds(self, a: str, b: str) -> float:
        end = self._events[b]
        end.synchronize()  # elapsed_time needs both events completed
        return float(self._events[a].elapsed_time(end)) / 1000.0

    def since(self, name: str) -> float:
        self.mark("_now")
        return self.seconds(name, "_now")


def step_clock(placement: Placement) -> StepClock:
    """The clock that measures compute on the plan's device."""
    if placement.device_type == "cuda":
        return CudaEventClock(placement.device)
    return WallClock()
