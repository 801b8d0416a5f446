"""One training process: run directly (nproc=1) or as a torchrun worker (`python -m training.worker`).

Timing is measured, not estimated: a DDP communication hook stamps the moment the last gradient
bucket is ready (end of this rank's backward compute); the rest of `backward()` is time spent
waiting in the all-reduce for slower ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from training.artifact import FORMAT_VERSION, write_artifact
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import TrainConfig
from training.data import Split, TabularDataset, load_data_dir
from training.errors import CheckpointError
from training.losses import SkewLoss
from training.metrics import classification_report
from training.model import MLPClassifier, ModelSpec, standardisation
from training.monitor import SkewMonitor, StepRecord
from training.progress import EpochProgress
from training.sampler import ClassBalancedSampler
from training.speed_balance import RankSpeedBalancer, slice_for_rank

logger = logging.getLogger(__name__)
# Fields whose change makes a checkpoint meaningless to resume.
RESUME_KEYS = (
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
)


@dataclass
class _HookState:
    process_group: Any
    slow_factor: float = 1.0
    step_start: float = 0.0
    compute_end: float = 0.0


def _timed_allreduce(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if bucket.is_last():
        now = time.monotonic()
        if state.slow_factor > 1.0:
            # A slow device takes slow_factor times as long for the same compute.
            time.sleep((state.slow_factor - 1.0) * (now - state.step_start))
            now = time.monotonic()
        state.compute_end = now
    return default_hooks.allreduce_hook(state.process_group, bucket)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
_timed_allreduce.__annotations__.update(bucket=dist.GradBucket, state=_HookState)
_timed_allreduce.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _init_distributed(cfg: TrainConfig) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world != cfg.nproc:
        raise RuntimeError(f"launched with WORLD_SIZE={world} but the config says nproc={cfg.nproc}")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    return rank, world


def _autocast(precision: str) -> Any:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == "bf16":
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    if precision == "fp16":
        if device != "cuda":
            raise RuntimeError("precision fp16 needs a CUDA GPU (use bf16 on CPU)")
        return torch.autocast(device_type="cuda", dtype=torch.float16)
    return torch.autocast(device_type=device, enabled=False)


def evaluate(model: torch.nn.Module, split: Split, classes: list[str]) -> dict[str, Any]:
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(split.features))
    model.train()
    return classification_report(split.labels, logits.argmax(dim=1).numpy(), classes)


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
        self.rank, self.world = _init_distributed(cfg)
        torch.set_num_threads(cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // cfg.nproc))
        self.data: TabularDataset = load_data_dir(cfg.data_dir, cfg.label_column)
        train = self.data.train
        self.counts = self.data.class_counts
        mean, std = standardisation(train.features)
        torch.manual_seed(cfg.seed)
        self.spec = ModelSpec(
            n_features=train.features.shape[1],
            n_classes=len(self.data.classes),
            width=cfg.width,
            depth=cfg.depth,
            dropout=cfg.dropout,
        )
        self.model = MLPClassifier(self.spec, mean, std)
        self.loss_fn = SkewLoss(cfg.loss, self.counts, tau=cfg.tau, gamma=cfg.focal_gamma)
        self.hook = _HookState(
            process_group=None, slow_factor=cfg.slow_factor if cfg.slow_rank == self.rank else 1.0
        )
        if self.world > 1:
            self.ddp: torch.nn.Module = DistributedDataParallel(self.model)
            self.ddp.register_comm_hook(self.hook, _timed_allreduce)  # type: ignore[operator]
        else:
            self.ddp = self.model
        self.sampler = ClassBalancedSampler(
            train.labels, self.world, self.rank, q=cfg.sampler_q, seed=cfg.seed
        )
        self.balancer = RankSpeedBalancer(self.world, enabled=cfg.speed_balance and self.world > 1)
        self.local_batch = max(1, cfg.global_batch_size // self.world)
        if self.balancer.enabled:
            self.steps_per_epoch = max(1, self.sampler.total // cfg.global_batch_size)
        else:
            self.steps_per_epoch = max(1, math.ceil(self.sampler.per_rank / self.local_batch))
        total_steps = self.steps_per_epoch * cfg.epochs
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(total_steps, int(cfg.warmup_fraction * total_steps))
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
        self.monitor = SkewMonitor(cfg.checkpoint_dir, self.rank, self.world, len(self.data.classes))
        self.x = torch.from_numpy(np.array(train.features, copy=True))
        self.y = torch.from_numpy(np.array(train.labels, copy=True))
        self.start_epoch = 0
        self.best_bacc = -1.0
        self.best_epoch = -1
        self.best_state: dict[str, torch.Tensor] | None = None
        self.stale_epochs = 0
        self.history: list[dict[str, Any]] = []

    # -- checkpoints -------------------------------------------------------------------------
    def _resume_signature(self) -> dict[str, Any]:
        return {k: getattr(self.cfg, k) for k in RESUME_KEYS} | {"data_hash": self.data.data_hash}

    def maybe_resume(self) -> None:
        if not self.cfg.resume:
            return
        state = load_checkpoint(self.cfg.checkpoint_dir)
        if state is None:
            if self.rank == 0:
                logger.warning(
                    "--resume given but %s has no checkpoint; starting from epoch 0", self.cfg.checkpoint_dir
                )
            return
        saved = state["signature"]
        diff = {k: (saved.get(k), v) for k, v in self._resume_signature().items() if saved.get(k) != v}
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
        self.best_bacc, self.best_epoch = state["best_bacc"], state["best_epoch"]
        self.best_state, self.stale_epochs, self.history = (
            state["best_state"],
            state["stale_epochs"],
            state["history"],
        )
        if self.rank == 0:
            logger.info("resumed from epoch %d", state["epoch"])

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

    def _step(self, idx: np.ndarray, global_n: int, epoch: int, step: int) -> tuple[float, StepRecord]:
        t0 = time.monotonic()
        index = torch.from_numpy(idx)
        xb, yb = self.x.index_select(0, index), self.y.index_select(0, index)
        t1 = time.monotonic()
        self.hook.step_start = t1
        with _autocast(self.cfg.precision):
            logits = self.ddp(xb)
        # sum * world / global batch: with DDP's mean all-reduce the update is the global-batch mean.
        loss = self.loss_fn(logits, yb).sum() * (self.world / global_n)
        self.scaler.scale(loss).backward()
        t2 = time.monotonic()
        if self.world == 1:
            if self.hook.slow_factor > 1:
                time.sleep((self.hook.slow_factor - 1) * (t2 - t1))
                t2 = time.monotonic()
            self.hook.compute_end = t2
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
        t3 = time.monotonic()
        compute = (self.hook.compute_end - t1) + (t3 - t2)
        rec = StepRecord(
            self.rank, epoch, step, len(idx), compute, t1 - t0, t2 - self.hook.compute_end, t3 - t0
        )
        if self.balancer.enabled:
            self.balancer.gather_and_observe(rec.compute_s)
        return float(loss.detach()) * global_n / self.world / max(1, len(idx)), rec

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        self.maybe_resume()
        bar = None
        if self.rank == 0 and cfg.progress:
            bar = EpochProgress(cfg.epochs, self.steps_per_epoch, self.start_epoch, sys.stderr)
        for epoch in range(self.start_epoch, cfg.epochs):
            # Per-epoch seeding makes dropout masks a function of (seed, epoch, rank): resume replays exactly.
            torch.manual_seed(cfg.seed * 100_003 + epoch * 101 + self.rank)
            self.monitor.start_epoch()
            self.ddp.train()
            start = time.monotonic()
            loss_sum = 0.0
            for step, (idx, global_n) in enumerate(self._batches(epoch)):
                loss, rec = self._step(idx, global_n, epoch, step)
                loss_sum += loss
                self.monitor.record(rec, self.data.train.labels[idx])
                if bar is not None:
                    bar.step()
            wall = time.monotonic() - start
            val = evaluate(self.model, self.data.val, self.data.classes)
            improved = val["balanced_accuracy"] > self.best_bacc
            if improved:
                self.best_bacc, self.best_epoch, self.stale_epochs = val["balanced_accuracy"], epoch, 0
                self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            else:
                self.stale_epochs += 1
            summary = self.monitor.finish_epoch(
                epoch,
                wall,
                {
                    "train_loss": round(loss_sum / self.steps_per_epoch, 5),
                    "val_balanced_accuracy": round(val["balanced_accuracy"], 5),
                    "val_macro_f1": round(val["macro_f1"], 5),
                    "rank_shares": [round(float(s), 4) for s in self.balancer.shares()],
                },
            )
            self.history.append(summary)
            if bar is not None:
                bar.end_epoch(
                    epoch, summary["train_loss"], val["balanced_accuracy"], summary["imbalance_ratio"]
                )
            self._checkpoint(epoch)
            if cfg.patience is not None and self.stale_epochs >= cfg.patience:
                if self.rank == 0:
                    logger.info(
                        "early stop at epoch %d: val balanced accuracy has not improved for %d epochs",
                        epoch,
                        cfg.patience,
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
        metrics = {"val": evaluate(self.model, self.data.val, self.data.classes)}
        if self.data.test is not None:
            metrics["test"] = evaluate(self.model, self.data.test, self.data.classes)
        epochs = self.history
        summary = {
            "epochs_run": len(epochs),
            "best_epoch": self.best_epoch,
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
            "model": {"family": "mlp", "hyperparameters": self.spec.model_dump()},
            "inputs": [{"name": n, "dtype": "float32"} for n in self.data.feature_names],
            "normalisation": {
                "mean": self.model.feature_mean.tolist(),
                "std": self.model.feature_std.tolist(),
            },
            "classes": self.data.classes,
            "class_counts": [int(c) for c in counts],
            "class_priors": (counts / counts.sum()).tolist(),
            "metrics": headline,
            "provenance": {
                "data_dir": str(self.cfg.data_dir),
                "data_hash": self.data.data_hash,
                "seed": self.cfg.seed,
                "world_size": self.world,
                "precision": self.cfg.precision,
                "loss": self.cfg.loss,
                "tau": self.cfg.tau,
                "sampler_q": self.cfg.sampler_q,
                "speed_balance": self.cfg.speed_balance,
                "global_batch_size": self.cfg.global_batch_size,
                "lr": self.cfg.lr,
                "torch": torch.__version__,
            }
            | summary,
        }
        write_artifact(self.cfg.out_dir, self.model, metadata, metrics, self.data.classes)
        return metadata


def run(cfg: TrainConfig) -> dict[str, Any]:
    return Trainer(cfg).fit()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="skewserve training worker (launched by `skewserve train`)")
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s rank" + os.environ.get("RANK", "0") + " %(name)s: %(message)s",
    )
    cfg = TrainConfig.model_validate(json.loads(open(args.config).read()))
    run(cfg)


if __name__ == "__main__":
    main()
