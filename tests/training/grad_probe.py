"""Run the trainer's real step once and save the gradient the optimizer receives.

Under torchrun (2 gloo ranks) each rank takes its throughput-weighted, unequal slice of the first
global batch (`Trainer._batches`, the real split) and runs `Trainer._step` (forward, the scaled loss,
DDP's all-reduce in backward, optimizer step). Without torchrun (one process) it runs `_step` on the
whole global batch that rank 0 saved. The gradient is read by an optimizer step pre-hook, a public
PyTorch API, at the moment the optimizer would use it: nothing in the step is re-typed here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from training.config import TrainConfig
from training.worker import Trainer

LOSSES = ("logit_adjusted", "focal", "weighted_ce")
GLOBAL_BATCH = 64
UNEQUAL_SHARES = [0.75, 0.25]  # rank 0 measured three times as fast as rank 1


def stepped_gradient(trainer: Trainer, idx: np.ndarray, global_n: int) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for name, p in trainer.model.named_parameters():
            assert p.grad is not None, name
            grads[name] = p.grad.detach().clone()

    handle = trainer.optimizer.register_step_pre_hook(capture)
    trainer.clock.start()
    trainer._step(trainer.fetch(np.asarray(idx)), global_n, epoch=0, step=0)
    handle.remove()
    return grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    for loss in LOSSES:
        cfg = TrainConfig(
            data_dir=args.data,
            out_dir=args.out / loss / f"world{world}",
            nproc=world,
            loss=loss,  # type: ignore[arg-type]
            dropout=0.0,  # dropout masks depend on the batch's shape: off, so both sides compute the same function
            input_noise=0.0,  # noise is drawn per rank and batch shape: off, for the same reason
            grad_clip=None,  # clipping rescales the gradient; the comparison is of the gradient itself
            global_batch_size=GLOBAL_BATCH,
            threads_per_rank=1,
            progress=False,
        )
        trainer = Trainer(cfg)
        saved = args.out / loss / f"rank{rank}.pt"
        if world > 1:
            trainer.balancer.load_state_dict({"shares": UNEQUAL_SHARES})
            counts = trainer.balancer.split(GLOBAL_BATCH)
            idx, global_n = next(trainer._batches(0))
            batch = trainer.sampler.global_indices(0)[:GLOBAL_BATCH]
            grads = stepped_gradient(trainer, idx, global_n)
            torch.save({"grads": grads, "counts": counts, "local": idx, "batch": batch}, saved)
        else:
            batch = torch.load(args.out / loss / "rank0.pt", weights_only=False)["batch"]
            torch.save({"grads": stepped_gradient(trainer, batch, len(batch))}, args.out / loss / "single.pt")
        trainer.monitor.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    # Three trainers (three DDP reducers on gloo) in one process: about one exit in ten, a C++
    # thread still joinable at interpreter teardown aborts rank 0 ("terminate called without an
    # active exception") after every result was saved. The results are on disk and the group is
    # destroyed, so skip the teardown rather than let it decide the exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
