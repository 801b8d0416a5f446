"""Launch training: in-process for one rank, `torchrun` (PyTorch's elastic launcher) for several."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from training.config import TrainConfig
from training.errors import TrainingError


def torchrun_command(cfg: TrainConfig, config_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={cfg.nproc}",
        "--max-restarts=0",
        "-m",
        "training.worker",
        "--config",
        str(config_path),
    ]


def train(cfg: TrainConfig, log_path: Path | None = None) -> dict[str, Any]:
    """Train and return the artifact's metadata; raises TrainingError with the workers' reason."""
    if cfg.nproc == 1:
        from training.worker import run

        run(cfg)
    else:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        config_path = cfg.out_dir / "train_config.json"
        config_path.write_text(cfg.model_dump_json(indent=2))
        env = dict(os.environ)
        threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // cfg.nproc)
        env["OMP_NUM_THREADS"] = str(threads)
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(open(log_path, "w")) if log_path is not None else None
            proc = subprocess.run(
                torchrun_command(cfg, config_path),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT if log is not None else None,
            )
        if proc.returncode != 0:
            hint = f"; see {log_path}" if log_path else ""
            raise TrainingError(f"torchrun exited with code {proc.returncode}{hint}")
    meta_path = cfg.out_dir / "metadata.json"
    if not meta_path.is_file():
        raise TrainingError(f"training finished but wrote no artifact at {cfg.out_dir}")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    return meta
