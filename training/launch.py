"""Launch training: in-process for one rank, `torchrun` (PyTorch's elastic launcher) for several.

One node: torchrun --standalone. Several nodes: one torchrun agent per node, all given the same
--rdzv-endpoint (the c10d rendezvous store, hosted by the agent whose address it names) and
--rdzv-id; global ranks are assigned at rendezvous. With --max-restarts the agents restart the
whole job after a worker fails (a new rendezvous round with a fresh store, see `torchrun_env`)
and the workers resume from the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.config import TrainConfig
from training.errors import TrainingError

logger = logging.getLogger(__name__)


def torchrun_command(cfg: TrainConfig, config_path: Path) -> list[str]:
    """The torchrun command line of this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if cfg.nnodes == 1 and cfg.rdzv_endpoint is None:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        assert cfg.rdzv_endpoint is not None  # the config refuses nnodes > 1 without one
        cmd += [
            f"--nnodes={cfg.nnodes}",
            f"--rdzv-backend={cfg.rdzv_backend}",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}",
            f"--rdzv-id={cfg.rdzv_id}",
        ]
        if cfg.node_rank is not None:
            cmd.append(f"--node-rank={cfg.node_rank}")
        if cfg.local_addr is not None:
            cmd.append(f"--local-addr={cfg.local_addr}")
    return cmd + [
        f"--nproc-per-node={cfg.nproc}",
        f"--max-restarts={cfg.max_restarts}",
        "-m",
        "training.worker",
        "--config",
        str(config_path),
    ]


def torchrun_env(cfg: TrainConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of this node's torchrun agent (and so of its workers)."""
    env = dict(base)
    # torchrun's c10d rendezvous hands its workers one TCPStore, kept by the agent across restarts,
    # and the process group writes the same keys in every round: after a worker fails, a restarted
    # gloo rank can read its peer's address of the previous round and connectFullMesh is refused
    # (pytorch/pytorch#135712). Opting out gives every round a fresh store, hosted by global rank 0
    # on a new port. A user's own setting wins.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if cfg.threads_per_rank:
        env["OMP_NUM_THREADS"] = str(cfg.threads_per_rank)
    else:  # a user's OMP_NUM_THREADS wins over the even split of this node's cores
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    return env


def _write_atomically(path: Path, text: str) -> None:
    # Several nodes may write the same file into a shared directory: each writes aside and renames.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def preflight(cfg: TrainConfig) -> None:
    """Check the data and the model once, in this process, before any rank starts.

    Every rank would otherwise meet the same bad file or the same wrong output shape, and each
    would print its traceback under torchrun's own report; here the problem is one DataError or
    ModelError naming it (the ranks repeat the checks, which then pass).
    """
    import numpy as np

    from training.data_source import open_configured
    from training.datasets import SplitDataset
    from training.factory import build, check_output

    data = open_configured(cfg, augment=False)
    for note in data.warnings:
        logger.warning("data: %s", note)
    model, _ = build(cfg.model, cfg.factory_args(), data.spec)
    probe = SplitDataset(data.train, data.spec).__getitems__(list(np.arange(min(4, len(data.train)))))
    check_output(model, probe[0], data.spec, cfg.model)
    if cfg.distill_from is not None:
        from training.distill import check_teacher

        check_teacher(cfg.distill_from, data.spec)


def train(cfg: TrainConfig, log_path: Path | None = None) -> dict[str, Any]:
    """Train and return the artifact's metadata; raises TrainingError with the workers' reason."""
    if cfg.world_size == 1 and cfg.max_restarts == 0:
        from training.worker import run

        run(cfg)
    else:
        if cfg.node_rank in (None, 0):  # every node would find the same problem; one says it
            preflight(cfg)
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        config_path = cfg.out_dir / "train_config.json"
        _write_atomically(config_path, cfg.model_dump_json(indent=2))
        env = torchrun_env(cfg, os.environ)
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
        # The workers' copy of the config, needed only while they run: the artifact's metadata.json
        # records the run (a failed run keeps it, for --resume and for a look at what ran).
        config_path.unlink(missing_ok=True)
    meta_path = cfg.out_dir / "metadata.json"
    if not meta_path.is_file() and cfg.nnodes > 1:
        # Global rank 0 writes the artifact; with a per-node --out it is on the node that held rank 0.
        logger.info("this node did not hold global rank 0: the artifact is in --out on the node that did")
        return {}
    if not meta_path.is_file():
        raise TrainingError(f"training finished but wrote no artifact at {cfg.out_dir}")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    return meta
