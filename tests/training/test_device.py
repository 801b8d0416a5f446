"""Device placement plans (every branch, on any machine), the CPU step clock, and the CUDA paths."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

from training.device import (
    CudaEventClock,
    HostCapabilities,
    Placement,
    WallClock,
    autocast,
    gather_batch,
    grad_scaler,
    host_capabilities,
    plan_placement,
    step_clock,
    to_device,
)
from training.errors import ConfigError

CPU_HOST = HostCapabilities(cuda_available=False)
AMPERE_X4 = HostCapabilities(cuda_available=True, cuda_device_count=4, bf16_supported=True)
TURING_X2 = HostCapabilities(cuda_available=True, cuda_device_count=2, bf16_supported=False)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")


def _expected(host: HostCapabilities, local_rank: int, precision: str, device: str) -> Placement | str:
    """The specification of plan_placement, written out independently as a table of rules."""
    if device == "cuda" and not host.cuda_available:
        return "device cuda was asked for but torch sees no CUDA GPU"
    cuda = host.cuda_available and device != "cpu"
    if cuda and local_rank >= host.cuda_device_count:
        return f"LOCAL_RANK={local_rank} but this node has {host.cuda_device_count} visible CUDA GPU(s)"
    if precision == "fp16" and not cuda:
        return "precision fp16 needs a CUDA GPU"
    if precision == "bf16" and cuda and not host.bf16_supported:
        return "precision bf16 is not supported by this GPU"
    resolved = (
        precision if precision != "auto" else ("bf16" if host.bf16_supported else "fp16") if cuda else "fp32"
    )
    return Placement(
        device_type="cuda" if cuda else "cpu",
        device_index=local_rank if cuda else None,
        local_rank=local_rank,
        backend="nccl" if cuda else "gloo",
        precision=resolved,  # type: ignore[arg-type]
        autocast_dtype={"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[resolved],
        grad_scaler=resolved == "fp16",
        pin_memory=cuda,
    )


@pytest.mark.parametrize(
    ("host", "local_rank", "precision", "device"),
    list(
        itertools.product(
            [CPU_HOST, AMPERE_X4, TURING_X2],
            [0, 1, 3],
            ["auto", "fp32", "bf16", "fp16"],
            ["auto", "cpu", "cuda"],
        )
    ),
)
def test_plan_matches_the_rules_for_every_combination(
    host: HostCapabilities, local_rank: int, precision: str, device: str
) -> None:
    expected = _expected(host, local_rank, precision, device)
    env = {"LOCAL_RANK": str(local_rank), "RANK": "7", "WORLD_SIZE": "8"}
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            plan_placement(env, host, precision, device)  # type: ignore[arg-type]
    else:
        assert plan_placement(env, host, precision, device) == expected  # type: ignore[arg-type]


def test_cuda_rank_binds_its_local_gpu_for_ddp_and_nccl() -> None:
    plan = plan_placement({"LOCAL_RANK": "3"}, AMPERE_X4)
    assert plan.device == torch.device("cuda", 3)
    assert plan.ddp_device_ids == [3] and plan.backend == "nccl"
    assert (plan.precision, plan.autocast_dtype, plan.grad_scaler) == ("bf16", torch.bfloat16, False)
    older = plan_placement({"LOCAL_RANK": "1"}, TURING_X2)
    assert (older.precision, older.autocast_dtype, older.grad_scaler) == ("fp16", torch.float16, True)


def test_cpu_plan_is_gloo_fp32_without_device_ids() -> None:
    plan = plan_placement({}, CPU_HOST)  # one process without torchrun: LOCAL_RANK absent means 0
    assert plan.device == torch.device("cpu") and plan.ddp_device_ids is None
    assert (plan.backend, plan.precision, plan.pin_memory) == ("gloo", "fp32", False)


@pytest.mark.parametrize("raw", ["x", "-1", ""])
def test_bad_local_rank_is_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"LOCAL_RANK={raw!r}|LOCAL_RANK=-1 is negative"):
        plan_placement({"LOCAL_RANK": raw}, AMPERE_X4)


def test_cpu_helpers_follow_the_plan() -> None:
    plan = plan_placement({}, CPU_HOST, precision="bf16")
    source = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    x = gather_batch(source, torch.tensor([3, 1]), plan)
    assert torch.equal(x, source[[3, 1]]) and to_device(x, plan) is x
    with autocast(plan):
        y = torch.nn.functional.linear(x, torch.ones(2, 3))
    assert y.dtype == torch.bfloat16
    with autocast(plan_placement({}, CPU_HOST)):
        assert torch.nn.functional.linear(x, torch.ones(2, 3)).dtype == torch.float32
    assert not grad_scaler(plan).is_enabled()
    assert isinstance(step_clock(plan), WallClock)


def test_host_capabilities_agree_with_torch() -> None:
    caps = host_capabilities()
    assert caps.cuda_available == torch.cuda.is_available()
    assert caps.cuda_device_count == (torch.cuda.device_count() if caps.cuda_available else 0)


def test_wall_clock_reports_exact_differences_of_its_clock() -> None:
    ticks = iter([10.0, 10.5, 12.0, 12.25, 13.0, 20.0])
    clock = WallClock(clock=lambda: next(ticks))
    clock.start()  # 10.0
    clock.mark("batch_ready")  # 10.5
    clock.mark("compute_end")  # 12.0
    clock.mark("step_end")  # 12.25
    assert clock.seconds("start", "batch_ready") == 0.5
    assert clock.seconds("batch_ready", "compute_end") == 1.5
    assert clock.seconds("compute_end", "step_end") == 0.25
    assert clock.since("batch_ready") == 2.5  # now = 13.0
    clock.start()  # a new step (at 20.0) forgets the old points
    with pytest.raises(KeyError):
        clock.seconds("start", "step_end")


def test_wall_clock_measures_real_work_in_order() -> None:
    clock = WallClock()
    clock.start()
    a = torch.randn(64, 64)
    for _ in range(10):
        a = a @ a.T / 64
    clock.mark("done")
    total, part = clock.seconds("start", "done"), clock.since("start")
    assert 0 < total <= part  # since() reads the clock later than the mark
    assert clock.seconds("start", "start") == 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_event_clock_measures_device_time_not_launch_time() -> None:
    plan = plan_placement({"LOCAL_RANK": "0"}, host_capabilities())
    clock = step_clock(plan)
    assert isinstance(clock, CudaEventClock)
    a = torch.randn(4096, 4096, device=plan.device)
    torch.cuda.synchronize()
    clock.start()
    launch_start = time.monotonic()
    for _ in range(20):
        a = a @ a / 4096
    launch_s = time.monotonic() - launch_start  # the host only queued the kernels
    clock.mark("done")
    device_s = clock.seconds("start", "done")
    assert device_s > launch_s  # events saw the kernels run; host stamps saw them queued


@pytest.mark.gpu
@needs_cuda
def test_cuda_batches_move_pinned_and_autocast_is_active() -> None:
    plan = plan_placement({"LOCAL_RANK": "0"}, host_capabilities())
    source = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    moved = gather_batch(source, torch.tensor([5, 0, 2]), plan)
    assert moved.device == plan.device and torch.equal(moved.cpu(), source[[5, 0, 2]])
    pinned = to_device(source, plan)
    assert pinned.device == plan.device
    with autocast(plan):
        y = torch.nn.functional.linear(moved, torch.ones(2, 3, device=plan.device))
    assert y.dtype == plan.autocast_dtype
    assert grad_scaler(plan).is_enabled() == (plan.precision == "fp16")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_rank_trains_on_cuda_and_records_it(small_data: Path, tmp_path: Path, precision: str) -> None:
    from training.config import TrainConfig
    from training.launch import train

    cfg = TrainConfig(
        data_dir=small_data,
        out_dir=tmp_path / precision,
        device="cuda",
        precision=precision,  # type: ignore[arg-type]
        max_steps=60,
        progress=False,
    )
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        with pytest.raises(ConfigError, match="precision bf16 is not supported by this GPU"):
            train(cfg)
        return
    meta = train(cfg)
    prov = meta["provenance"]
    assert (prov["device"], prov["precision"]) == ("cuda", precision)
    assert prov["device_name"] == torch.cuda.get_device_name(0)
    assert meta["metrics"]["test"]["balanced_accuracy"] > 1 / len(meta["classes"])  # it learned
    weights = torch.load(tmp_path / precision / "model.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in weights.values())  # the artifact holds CPU weights
