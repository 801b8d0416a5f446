"""One training process: run directly (nproc=1) or as a torchrun worker (`python -m training.worker`).

Each rank runs where `training.device.plan_placement` puts it: on CUDA, the GPU numbered LOCAL_RANK
(set_device, DDP device_ids, NCCL, pinned non-blocking batch copies, autocast and the fp16 gradient
scaler); on the CPU, gloo and fp32 or bf16 autocast.

Timing is measured, not estimated: a DDP communication hook marks the moment the last gradient
bucket is ready (end of this rank's backward compute); the rest of `backward()` is time spent
waiting in the all-reduce for slower ranks. Marks go through a `StepClock`: CUDA events on a GPU
(device time, not kernel-launch time), the monotonic clock on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from training.artifact import FORMAT_VERSION, write_artifact
from training.budget import (
    SmoothedEarlyStopping,
    resolve_budget,
    resolve_input_noise,
    resolve_weight_decay,
)
from training.checkpoint import load_newest_checkpoint, save_checkpoint
from training.config import TrainConfig
from training.data_source import open_configured
from training.datasets import Batch, LabelledData, SplitDataset, identity_collate
from training.device import (
    Placement,
    StepClock,
    activate,
    autocast,
    grad_scaler,
    host_capabilities,
    plan_placement,
    step_clock,
    to_device,
)
from training.distill import DistillationLoss, Teacher
from training.errors import CheckpointError
from training.factory import build as build_model
from training.factory import check_output
from training.losses import SkewLoss
from training.metrics import classification_report
from training.monitor import SkewMonitor
from training.progress import EpochProgress
from training.sampler import ClassBalancedSampler
from training.speed_balance import RankSpeedBalancer, slice_for_rank
from training.step_record import StepRecord

logger = logging.getLogger(__name__)
# Fields whose change makes a checkpoint meaningless to resume.
RESUME_KEYS = (
    "val_fraction",
    "model",
    "model_args",
    "image_size",
    "channels",
    "loss",
    "tau",
    "sampler_q",
    "width",
    "depth",
    "dropout",
    "global_batch_size",
    "lr",
    "seed",
    "nproc",
    "precision",
    "epochs",
    "max_steps",
    "min_steps",
    "budget_epochs",
    "input_noise",
    "weight_decay",
    "nnodes",
)
# Distillation's settings, in the signature only when distilling: checkpoints of runs without a
# teacher (and those written before distillation existed) keep the signature they had.
DISTILL_RESUME_KEYS = ("distill_from", "distill_weight", "distill_temperature")


@dataclass
class _HookState:
    process_group: Any
    clock: StepClock
    slow_factor: float = 1.0


def _timed_allreduce(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if bucket.is_last():
        if state.slow_factor > 1.0:
            # A slow device takes slow_factor times as long for the same compute.
            time.sleep((state.slow_factor - 1.0) * state.clock.since("batch_ready"))
        state.clock.mark("compute_end")
    return default_hooks.allreduce_hook(state.process_group, bucket)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
_timed_allreduce.__annotations__.update(bucket=dist.GradBucket, state=_HookState)
_timed_allreduce.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _init_distributed(cfg: TrainConfig, placement: Placement) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world != cfg.world_size:
        raise RuntimeError(
            f"launched with WORLD_SIZE={world} but the config says nproc={cfg.nproc} x nnodes={cfg.nnodes}"
        )
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=placement.backend)
    return rank, world


def _all_gather_floats(values: list[float], world: int, device: torch.device) -> np.ndarray:
    """Every rank's values as a (world, len) array; the tensors live where the backend needs them."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    if world == 1 or not dist.is_initialized():
        return local.cpu().numpy()[None, :]
    out = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(out, local)
    return torch.stack(out).cpu().numpy()


EVAL_BATCH = 256


def evaluate(
    model: torch.nn.Module,
    dataset: SplitDataset,
    classes: list[str],
    device: torch.device | None = None,
    workers: int = 0,
) -> dict[str, Any]:
    """Metrics of `model` on a whole split, read in order through a DataLoader (workers decode)."""
    n = len(dataset)
    batches = [list(range(i, min(n, i + EVAL_BATCH))) for i in range(0, n, EVAL_BATCH)]
    # Worker processes pay off only on a split of several batches: a small one reads faster in-process.
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=identity_collate,
        num_workers=workers if len(batches) > 4 else 0,
        generator=torch.Generator(),  # its workers' seed: never drawn from the training stream
    )
    preds = []
    model.eval()
    with torch.no_grad():
        for inputs, _ in loader:
            logits = model(*(t.to(device or torch.device("cpu")) for t in inputs))
            preds.append(logits.argmax(dim=1).cpu().numpy())
    model.train()
    pred = np.concatenate(preds) if preds else np.zeros(0, dtype=np.int64)
    return classification_report(dataset.split.labels, pred, classes)


class EpochBatches:
    """The DataLoader's batch sampler: this rank's index lists of the current epoch, in step order."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.epoch = 0

    def __iter__(self) -> Any:
        for idx, _ in self.trainer._batches(self.epoch):
            yield idx.tolist()

    def __len__(self) -> int:
        return self.trainer.steps_per_epoch


def resolve_workers(cfg: TrainConfig, kind: str) -> int:
    """DataLoader workers per rank: tables live in memory (0); other data decodes or reads from disk."""
    if cfg.data_workers != "auto":
        return int(cfg.data_workers)
    if kind == "table":
        return 0
    return max(1, min(4, (os.cpu_count() or 1) // (cfg.nproc or 1)))


def _lr_lambda(total_steps: int, warmup_steps: int) -> Any:
    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.placement = plan_placement(os.environ, host_capabilities(), cfg.precision, cfg.device)
        activate(self.placement)  # before the process group: NCCL binds to the current device
        self.device = self.placement.device
        self.rank, self.world = _init_distributed(cfg, self.placement)
        # An explicit OMP_NUM_THREADS (the launcher's or the user's) wins over the per-node split.
        omp = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        torch.set_num_threads(cfg.threads_per_rank or omp or max(1, (os.cpu_count() or 1) // cfg.nproc))
        self.data: LabelledData = open_configured(cfg)
        if self.rank == 0:
            for note in self.data.warnings:
                logger.warning("data: %s", note)
        spec = self.data.spec
        self.train_set = SplitDataset(self.data.train, spec)
        self.val_set = SplitDataset(self.data.val, spec)
        self.counts = self.data.class_counts
        n_rows = len(self.data.train)
        n_features = int(np.prod([max(1, d) for d in spec.inputs[0].shape])) if spec.inputs else 1
        if spec.kind == "table":
            self.input_noise = resolve_input_noise(cfg, n_rows, n_features)
            self.weight_decay = resolve_weight_decay(cfg, n_rows, n_features)
        else:
            # The ridge-like auto settings are fitted to tables; images get augmentation instead.
            self.input_noise = 0.0 if cfg.input_noise == "auto" else float(cfg.input_noise)
            self.weight_decay = 0.05 if cfg.weight_decay == "auto" else float(cfg.weight_decay)
        self.model_args = cfg.factory_args(input_noise=self.input_noise)
        torch.manual_seed(cfg.seed)
        model, self.model_record = build_model(cfg.model, self.model_args, spec)
        probe = self.train_set.__getitems__(list(range(min(4, n_rows))))
        check_output(model, probe[0], spec, cfg.model)
        if self.world > 1 and self.placement.device_type == "cuda":
            # Batch statistics over the global batch, not each rank's (possibly tiny) share of it.
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = model.to(self.device)
        self.loss_fn = SkewLoss(cfg.loss, self.counts, tau=cfg.tau, gamma=cfg.focal_gamma).to(self.device)
        self.distill: DistillationLoss | None = None
        if cfg.distill_from is not None:
            # Loaded once per rank, beside the student: each rank scores its own share of the batch.
            teacher = Teacher(cfg.distill_from, spec, cfg.tau).to(self.device)
            self.distill = DistillationLoss(
                self.loss_fn, teacher, cfg.distill_weight, cfg.distill_temperature
            )
        self.clock: StepClock = step_clock(self.placement)
        self.hook = _HookState(
            process_group=None,
            clock=self.clock,
            slow_factor=cfg.slow_factor if cfg.slow_rank == self.rank else 1.0,
        )
        if self.world > 1:
            self.ddp: torch.nn.Module = DistributedDataParallel(
                self.model,
                device_ids=self.placement.ddp_device_ids,
                output_device=self.placement.device_index,
            )
            self.ddp.register_comm_hook(self.hook, _timed_allreduce)  # type: ignore[operator]
        else:
            self.ddp = self.model
        self.sampler = ClassBalancedSampler(
            self.data.train.labels, self.world, self.rank, q=cfg.sampler_q, seed=cfg.seed
        )
        self.balancer = RankSpeedBalancer(self.world, enabled=cfg.speed_balance and self.world > 1)
        self.local_batch = max(1, cfg.global_batch_size // self.world)
        if self.balancer.enabled:
            self.steps_per_epoch = max(1, self.sampler.total // cfg.global_batch_size)
        else:
            self.steps_per_epoch = max(1, math.ceil(self.sampler.per_rank / self.local_batch))
        self.budget = resolve_budget(cfg, self.steps_per_epoch, len(self.data.val))
        self.early_stop = SmoothedEarlyStopping(self.budget)
        if self.rank == 0:
            logger.info(
                "budget: %s; input noise %.3f; weight decay %.3f",
                self.budget.reason,
                self.input_noise,
                self.weight_decay,
            )
        total_steps = self.budget.total_steps
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=self.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(total_steps, int(cfg.warmup_fraction * total_steps))
        )
        self.scaler = grad_scaler(self.placement)
        # Batches are read by DataLoader workers (tables: in this process), pinned on CUDA and copied
        # non_blocking; the batch sampler hands out this rank's share of each global batch.
        self.workers = resolve_workers(cfg, spec.kind)
        if self.world > 1:
            # The loader draws a step's indices (and so its rank-speed split) a fixed number of steps
            # ahead, workers x prefetch; every rank must draw at the same lag, or their slices of one
            # global batch would come from different splits. Nodes with other core counts agree on
            # the smallest count.
            self.workers = int(_all_gather_floats([float(self.workers)], self.world, self.device).min())
        self.epoch_batches = EpochBatches(self)
        self.loader = torch.utils.data.DataLoader(
            self.train_set,
            batch_sampler=self.epoch_batches,
            collate_fn=identity_collate,
            num_workers=self.workers,
            pin_memory=self.placement.pin_memory,
            persistent_workers=self.workers > 0,
            prefetch_factor=4 if self.workers > 0 else None,
            # Each iterator draws its workers' base seed from this generator, not from torch's global
            # one: otherwise every epoch's (and every evaluation's) loader shifts the stream dropout
            # and input noise draw from, and results depend on how often the loop evaluates.
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        # Last: it opens the step log and the live metrics listener, which `run` closes if the run
        # fails (nothing after this line can fail before `fit`).
        self.monitor = SkewMonitor(
            cfg.checkpoint_dir, self.rank, self.world, len(self.data.classes), device=self.device
        )
        self.start_epoch = 0
        self.resumed_from_epoch: int | None = None
        self.elastic_restarts = 0  # torchrun restarts of the job before this run, agreed by all ranks
        self.best_bacc = -1.0
        self.best_epoch = -1
        self.best_state: dict[str, torch.Tensor] | None = None
        self.stale_epochs = 0
        self.history: list[dict[str, Any]] = []

    # -- checkpoints -------------------------------------------------------------------------
    def _resume_signature(self) -> dict[str, Any]:
        signature = {k: getattr(self.cfg, k) for k in RESUME_KEYS} | {"data_hash": self.data.data_hash}
        if self.distill is not None:
            signature |= {k: getattr(self.cfg, k) for k in DISTILL_RESUME_KEYS}
            signature["distill_from"] = str(self.cfg.distill_from)
            # The same path retrained is another teacher.
            signature["teacher_sha256"] = self.distill.teacher.record["sha256"]
        return signature

    def maybe_resume(self) -> None:
        # torchrun's elastic restarts (--max-restarts) relaunch every worker: they continue from the
        # checkpoint as if --resume had been given. TORCHELASTIC_RESTART_COUNT is counted per agent:
        # an agent whose own workers were healthy restarts them for the re-rendezvous without
        # counting, so after one node's worker fails the nodes disagree (1 vs 0). The ranks agree on
        # the largest count, since loading the checkpoint is a collective every rank must join
        # (a rank that skipped it left the others in all_gather and the restarted job hung).
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        want = int(self.cfg.resume)
        if self.world > 1 and dist.is_initialized():
            agreed = _all_gather_floats([float(want), float(restarts)], self.world, self.device).max(axis=0)
            want, restarts = int(agreed[0]), int(agreed[1])
        self.elastic_restarts = restarts
        if not want and restarts == 0:
            return
        # Each rank reads its node's view of the directory; all take the newest (see checkpoint.py).
        state = load_newest_checkpoint(self.cfg.checkpoint_dir, self.world, self.device)
        if state is None:
            if self.rank == 0:
                logger.warning(
                    "resume asked for (--resume or restart %d) but %s has no checkpoint; starting from epoch 0",
                    restarts,
                    self.cfg.checkpoint_dir,
                )
            return
        saved = state["signature"]
        now = self._resume_signature()
        # Both ways: a key only one side has (distilling now, or only then) is a change too.
        diff = {k: (saved.get(k), now.get(k)) for k in [*now, *(k for k in saved if k not in now)]}
        diff = {k: (a, b) for k, (a, b) in diff.items() if a != b}
        if diff:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise CheckpointError(
                f"cannot resume: the run's settings changed ({detail}); restore them or drop --resume"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.balancer.load_state_dict(state["balancer"])
        self.start_epoch = int(state["epoch"]) + 1
        self.early_stop.load_state_dict(state["early_stop"])
        self.resumed_from_epoch = int(state["epoch"])
        self.best_bacc, self.best_epoch = state["best_bacc"], state["best_epoch"]
        self.best_state, self.stale_epochs, self.history = (
            state["best_state"],
            state["stale_epochs"],
            state["history"],
        )
        if self.rank == 0:
            logger.info("resumed from epoch %d (elastic restart %d)", state["epoch"], restarts)

    def _checkpoint(self, epoch: int) -> None:
        if self.rank == 0:
            save_checkpoint(
                self.cfg.checkpoint_dir,
                {
                    "epoch": epoch,
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "balancer": self.balancer.state_dict(),
                    "best_bacc": self.best_bacc,
                    "best_epoch": self.best_epoch,
                    "best_state": self.best_state,
                    "stale_epochs": self.stale_epochs,
                    "history": self.history,
                    "early_stop": self.early_stop.state_dict(),
                    "signature": self._resume_signature(),
                },
            )
        if self.world > 1:
            dist.barrier()

    # -- steps -------------------------------------------------------------------------------
    def _batches(self, epoch: int) -> Any:
        self.sampler.set_epoch(epoch)
        if self.balancer.enabled:
            order = self.sampler.global_indices()
            B = self.cfg.global_batch_size
            for s in range(self.steps_per_epoch):
                batch = order[s * B : (s + 1) * B]
                counts = self.balancer.split(len(batch))
                yield slice_for_rank(batch, counts, self.rank), len(batch)
        else:
            order = self.sampler.rank_indices()
            for s in range(self.steps_per_epoch):
                local = order[s * self.local_batch : (s + 1) * self.local_batch]
                yield local, len(local) * self.world

    def fetch(self, idx: np.ndarray) -> Batch:
        """Read a batch in this process (the loader's workers do this during training)."""
        return self.train_set.__getitems__(idx.tolist())

    def _step(self, batch: Batch, global_n: int, epoch: int, step: int) -> tuple[float, StepRecord]:
        """One optimizer step on a host batch; the caller started the clock before reading it."""
        clock = self.clock
        host_inputs, host_labels = batch
        inputs = tuple(to_device(t, self.placement) for t in host_inputs)
        yb = to_device(host_labels, self.placement)
        clock.mark("batch_ready")
        with autocast(self.placement):
            logits = self.ddp(*inputs)
        # sum * world / global batch: with DDP's mean all-reduce the update is the global-batch mean.
        # The loss is taken in fp32: logit adjustment adds log-priors that fp16 would round.
        per_sample = (
            self.loss_fn(logits.float(), yb)
            if self.distill is None
            else self.distill(logits.float(), yb, inputs)
        )
        loss = per_sample.sum() * (self.world / global_n)
        self.scaler.scale(loss).backward()
        if self.world == 1:
            if self.hook.slow_factor > 1:
                time.sleep((self.hook.slow_factor - 1) * clock.since("batch_ready"))
            clock.mark("compute_end")
        clock.mark("backward_end")
        self.scaler.unscale_(self.optimizer)
        if self.cfg.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            if self.monitor.exporter is not None:  # live metrics (training/metrics_export.py)
                self.monitor.exporter.gradient_norm(float(norm))
        elif self.monitor.exporter is not None:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.model.parameters() if p.grad is not None]
            )
            self.monitor.exporter.gradient_norm(float(norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        clock.mark("step_end")
        compute = clock.seconds("batch_ready", "compute_end") + clock.seconds("backward_end", "step_end")
        rec = StepRecord(
            self.rank,
            epoch,
            step,
            len(host_labels),
            compute,
            clock.seconds("start", "batch_ready"),
            clock.seconds("compute_end", "backward_end"),
            clock.seconds("start", "step_end"),
        )
        if self.balancer.enabled:
            self.balancer.observe(_all_gather_floats([rec.compute_s], self.world, self.device)[:, 0])
        return float(loss.detach()) * global_n / self.world / max(1, len(host_labels)), rec

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        self.maybe_resume()
        bar = None
        if self.rank == 0 and cfg.progress:
            bar = EpochProgress(self.budget.epochs, self.steps_per_epoch, self.start_epoch, sys.stderr)
        for epoch in range(self.start_epoch, self.budget.epochs):
            # Per-epoch seeding makes dropout masks a function of (seed, epoch, rank): resume replays exactly.
            torch.manual_seed(cfg.seed * 100_003 + epoch * 101 + self.rank)
            self.monitor.start_epoch()
            self.ddp.train()
            start = time.monotonic()
            loss_sum = 0.0
            self.epoch_batches.epoch = epoch
            batches = iter(self.loader)
            for step in range(self.steps_per_epoch):
                self.clock.start()
                batch = next(batches)
                # Full global batches with the balancer; equal local batches on every rank without it.
                global_n = self.cfg.global_batch_size if self.balancer.enabled else len(batch[1]) * self.world
                loss, rec = self._step(batch, global_n, epoch, step)
                loss_sum += loss
                self.monitor.record(rec, batch[1].numpy())
                if bar is not None:
                    bar.step()
            wall = time.monotonic() - start
            val = evaluate(self.model, self.val_set, self.data.classes, self.device, self.workers)
            steps_done = (epoch + 1) * self.steps_per_epoch
            improved, stop = self.early_stop.observe(steps_done, val["balanced_accuracy"])
            if improved:
                self.best_bacc, self.best_epoch, self.stale_epochs = val["balanced_accuracy"], epoch, 0
                if self.budget.select_best:
                    self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            else:
                self.stale_epochs += 1
            summary = self.monitor.finish_epoch(
                epoch,
                wall,
                {
                    "train_loss": round(loss_sum / self.steps_per_epoch, 5),
                    "val_balanced_accuracy": round(val["balanced_accuracy"], 5),
                    "val_balanced_accuracy_smoothed": round(self.early_stop.smoothed or 0.0, 5),
                    "val_macro_f1": round(val["macro_f1"], 5),
                    "rank_shares": [round(float(s), 4) for s in self.balancer.shares()],
                },
            )
            self.history.append(summary)
            if bar is not None:
                bar.end_epoch(
                    epoch, summary["train_loss"], val["balanced_accuracy"], summary["imbalance_ratio"]
                )
            last = epoch == self.budget.epochs - 1 or stop
            if last or (epoch + 1) % self.budget.checkpoint_every_epochs == 0:
                self._checkpoint(epoch)
            if stop:
                if self.rank == 0:
                    logger.info(
                        "early stop at epoch %d (step %d): smoothed val balanced accuracy has not "
                        "improved for %s steps",
                        epoch,
                        steps_done,
                        self.budget.patience_steps,
                    )
                break
        if bar is not None:
            bar.close()
        self.monitor.close()
        result = self._finish()
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()
        return result

    def _finish(self) -> dict[str, Any]:
        if self.rank != 0:
            return {}
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        metrics = {"val": evaluate(self.model, self.val_set, self.data.classes, self.device, self.workers)}
        if self.data.test is not None:
            test_set = SplitDataset(self.data.test, self.data.spec)
            metrics["test"] = evaluate(self.model, test_set, self.data.classes, self.device, self.workers)
        self.model.to("cpu")  # the artifact holds CPU weights whatever device trained them
        epochs = self.history
        summary = {
            "epochs_run": len(epochs),
            "steps_run": len(epochs) * self.steps_per_epoch,
            "budget": self.budget.reason,
            "input_noise": round(self.input_noise, 4),
            "weight_decay": round(self.weight_decay, 4),
            "best_epoch": self.best_epoch,
            # Which weights the artifact holds: the best-scoring epoch's, or the last epoch's.
            "weights_from": "best epoch" if self.best_state is not None else "final epoch",
            "mean_epoch_wall_s": float(np.mean([e["wall_s"] for e in epochs])) if epochs else 0.0,
            "mean_imbalance_ratio": float(np.mean([e["imbalance_ratio"] for e in epochs])) if epochs else 1.0,
        }
        counts = self.counts.astype(np.float64)
        headline = {
            split: {k: m[k] for k in ("balanced_accuracy", "macro_f1", "accuracy")}
            for split, m in metrics.items()
        }
        metadata = {
            "format_version": FORMAT_VERSION,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # How to rebuild the model: the factory (and a hash of a user's module), its arguments.
            "model": self.model_record,
            # The data contract: input tensors (dtype, per-item shape, -1 dynamic), preprocessing.
            "data_kind": self.data.spec.kind,
            "inputs": [i.as_dict() for i in self.data.spec.inputs],
            "preprocessing": self.data.spec.preprocessing,
            "classes": self.data.classes,
            "class_counts": [int(c) for c in counts],
            "class_priors": (counts / counts.sum()).tolist(),
            "metrics": headline,
            "provenance": {
                # Absolute: export finds the validation samples for its parity gate from any directory.
                "data_dir": str(Path(self.cfg.data_dir).resolve()),
                "label_column": self.cfg.label_column,
                "val_fraction": self.cfg.val_fraction,
                "data_hash": self.data.data_hash,
                "seed": self.cfg.seed,
                "world_size": self.world,
                "precision": self.placement.precision,
                "device": self.placement.device_type,
                "device_name": (
                    torch.cuda.get_device_name(self.device) if self.placement.device_type == "cuda" else "cpu"
                ),
                "nnodes": self.cfg.nnodes,
                "resumed_from_epoch": self.resumed_from_epoch,
                "elastic_restarts": self.elastic_restarts,
                "loss": self.cfg.loss,
                "tau": self.cfg.tau,
                "sampler_q": self.cfg.sampler_q,
                "speed_balance": self.cfg.speed_balance,
                "global_batch_size": self.cfg.global_batch_size,
                "lr": self.cfg.lr,
                "distillation": None
                if self.distill is None
                else {
                    "teacher": self.distill.teacher.record,
                    "weight": self.distill.weight,
                    "temperature": self.distill.temperature,
                },
                "torch": torch.__version__,
            }
            | summary,
        }
        write_artifact(self.cfg.out_dir, self.model, metadata, metrics, self.data.classes)
        return metadata


def run(cfg: TrainConfig) -> dict[str, Any]:
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    except BaseException:
        # A run that failed (a refused resume, bad data mid-epoch) in a process that goes on, as
        # `train` in-process does: its metrics port and step log are given back, not held until exit.
        # The run's own error is what the caller sees, even if closing fails too.
        with contextlib.suppress(Exception):
            trainer.monitor.close()
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="skewserve training worker (launched by `skewserve train`)")
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = parser.parse_args(argv)
    # A worker killed by a signal (SIGABRT from a C++ runtime, SIGSEGV) leaves every thread's Python
    # stack in the node's log instead of only torchrun's "Signal 6 received".
    faulthandler.enable(all_threads=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s rank" + os.environ.get("RANK", "0") + " %(name)s: %(message)s",
    )
    cfg = TrainConfig.model_validate(json.loads(open(args.config).read()))
    run(cfg)
    # The job is done (artifact written, every rank past the last barrier, the process group
    # destroyed): leave without interpreter finalization. There, C++ threads of torch's
    # distributed stack can abort the process ("terminate called without an active exception",
    # seen on a resumed two-node job under load); torchrun then counts a finished rank as failed,
    # ends its node, and the other node waits out its exit barrier (300 s).
    gc.collect()  # the trainer's DataLoader workers are shut down by its iterator's finaliser
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
