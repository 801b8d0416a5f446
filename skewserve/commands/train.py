"""`skewserve train`: a thin layer over `training.launch.train`.

Each option is declared once, in `TrainOptions`: its fields are named after the `TrainConfig` fields
they fill, so the command builds the config from them instead of listing every option a second time.
torch loads with the training modules, so they are imported inside the command: `--help` stays instant.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from skewserve.commands.foreground import setup_logging
from skewserve.commands.options import first_error, options_command
from skewserve.output import console, error, say

if TYPE_CHECKING:
    from training.config import TrainConfig


@dataclass(frozen=True)
class TrainOptions:
    """`skewserve train`'s options; each field fills the `TrainConfig` field of the same name."""

    data_dir: Annotated[
        Path,
        typer.Option(
            "--data",
            help="Directory with train/val[/test] .parquet or .csv. Or image folders (train/<class>/<images>) "
            "or tensor shards (train/labels.npy + <input>.npy); docs/models-and-data.md#bring-your-own-data.",
        ),
    ]
    out_dir: Annotated[Path, typer.Option("--out", help="Artifact directory (checkpoints inside).")] = Path(
        "runs/artifact"
    )
    label_column: Annotated[str, typer.Option("--label")] = "label"
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="Built-in family (mlp: tables; cnn: images; text: token ids) or your own MODULE:FACTORY "
            "(or path/to/file.py:FACTORY); docs/models-and-data.md#your-own-model.",
        ),
    ] = "mlp"
    model_args: Annotated[
        list[str],
        typer.Option(
            "--model-arg", help="KEY=VALUE passed to the model factory (repeatable), e.g. width=64."
        ),
    ] = field(default_factory=list)
    image_size: Annotated[
        int | None,
        typer.Option(
            "--image-size", min=1, help="Images: resize to SIZE x SIZE (default: the most common size)."
        ),
    ] = None
    channels: Annotated[
        int | None, typer.Option("--channels", help="Images: 1 (grey) or 3 (RGB); default: 1 if all grey.")
    ] = None
    augment: Annotated[
        bool, typer.Option("--augment/--no-augment", help="Images: random-shift augmentation in training.")
    ] = True
    skip_bad_files: Annotated[
        bool,
        typer.Option(
            "--skip-bad-files", help="Images: skip (and count) unreadable files instead of failing."
        ),
    ] = False
    val_fraction: Annotated[
        float | None,
        typer.Option(
            "--val-fraction",
            help="Tables without val.csv/.parquet: split this share of each class off train (stratified, by --seed).",
        ),
    ] = None
    data_workers: Annotated[
        str,
        typer.Option(
            "--data-workers", help="DataLoader workers per rank; auto: 0 for tables, else min(4, cores/rank)."
        ),
    ] = "auto"
    nproc: Annotated[
        int,
        typer.Option(
            "--nproc", min=1, help="Ranks per node; >1 launches torchrun (gloo on CPU, NCCL on CUDA)."
        ),
    ] = 1
    nnodes: Annotated[
        int, typer.Option("--nnodes", min=1, help="Nodes; run this command on each with the same flags.")
    ] = 1
    node_rank: Annotated[
        int | None,
        typer.Option("--node-rank", min=0, help="This node's rank (only with --rdzv-backend static)."),
    ] = None
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint", help="host:port of the rendezvous (one node's address), same on every node."
        ),
    ] = None
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", help="Job id shared by every node of one run.")] = (
        "skewserve"
    )
    rdzv_backend: Annotated[
        str, typer.Option("--rdzv-backend", help="c10d (ranks assigned at rendezvous) | static.")
    ] = "c10d"
    local_addr: Annotated[
        str | None,
        typer.Option("--local-addr", help="Address other nodes reach this node at (default: its hostname)."),
    ] = None
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            min=0,
            help="Elastic restarts of the job; restarted workers resume from the checkpoint.",
        ),
    ] = 0
    device: Annotated[
        str, typer.Option("--device", help="auto (CUDA GPU LOCAL_RANK when visible) | cpu | cuda.")
    ] = "auto"
    loss: Annotated[
        str,
        typer.Option(
            "--loss", help="ce | weighted_ce | effective_ce | focal | logit_adjusted | balanced_softmax"
        ),
    ] = "logit_adjusted"
    sampler_q: Annotated[
        float,
        typer.Option("--sampler-q", help="Class draw probability ∝ n_c^q (1 natural, 0 class-uniform)."),
    ] = 1.0
    distill_from: Annotated[
        Path | None,
        typer.Option(
            "--distill-from",
            help="Teacher artifact (e.g. the cloud model): the student also learns its balanced "
            "(logit-adjusted) outputs; same classes and inputs as --data; docs/training.md#distillation.",
        ),
    ] = None
    distill_weight: Annotated[
        float,
        typer.Option(
            "--distill-weight",
            min=0.0,
            max=1.0,
            help="Share w of the teacher term: (1-w) balanced loss + w T² KL.",
        ),
    ] = 0.5
    distill_temperature: Annotated[
        float, typer.Option("--distill-temperature", help="Softmax temperature T of the teacher term.")
    ] = 1.0
    epochs: Annotated[
        int | None,
        typer.Option("--epochs", min=1, help="Train exactly this many epochs instead of the step budget."),
    ] = None
    max_steps: Annotated[
        int | None,
        typer.Option(
            "--max-steps", min=1, help="Optimizer-step budget (default: max(--min-steps, 30 epochs))."
        ),
    ] = None
    min_steps: Annotated[
        int, typer.Option("--min-steps", min=1, help="Floor of the automatic step budget.")
    ] = 1000
    input_noise: Annotated[
        str,
        typer.Option(
            "--input-noise",
            help="Gaussian input noise in feature stds; auto: min(1.5, 3*sqrt(features/rows)).",
        ),
    ] = "auto"
    checkpoint_every_steps: Annotated[
        int,
        typer.Option(
            "--checkpoint-every-steps", min=1, help="Checkpoint at the first epoch end after this many steps."
        ),
    ] = 25
    global_batch_size: Annotated[
        int, typer.Option("--batch-size", help="Global batch size across ranks.")
    ] = 256
    lr: Annotated[float, typer.Option("--lr")] = 3e-3
    width: Annotated[int, typer.Option("--width")] = 128
    depth: Annotated[int, typer.Option("--depth")] = 2
    dropout: Annotated[float, typer.Option("--dropout")] = 0.1
    precision: Annotated[
        str,
        typer.Option(
            "--precision",
            help="auto (bf16 on GPUs that support it, else fp16; fp32 on CPU) | fp32 | bf16 | fp16 (CUDA, with a gradient scaler)",
        ),
    ] = "auto"
    patience: Annotated[
        str,
        typer.Option(
            "--patience",
            help="Early-stopping patience in steps on smoothed val balanced accuracy; auto adapts; 0 disables.",
        ),
    ] = "auto"
    speed_balance: Annotated[
        bool,
        typer.Option(
            "--speed-balance/--no-speed-balance", help="Re-split each global batch by rank throughput."
        ),
    ] = True
    slow_rank: Annotated[
        int | None, typer.Option("--slow-rank", help="Slow this rank down (reproduces a mixed fleet).")
    ] = None
    slow_factor: Annotated[
        float, typer.Option("--slow-factor", help="How many times slower --slow-rank runs.")
    ] = 1.0
    seed: Annotated[int, typer.Option("--seed")] = 0
    resume: Annotated[bool, typer.Option("--resume", help="Continue from OUT/checkpoints/last.pt.")] = False
    # Not a training setting: where the ranks serve their live metrics (an environment variable).
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=1,
            max=65535,
            help="Serve live Prometheus metrics per rank on 127.0.0.1:PORT+rank (throughput, data and "
            "all-reduce waits, imbalance, gradient norm).",
        ),
    ] = None

    def config(self) -> TrainConfig:
        """The `TrainConfig` these options set (pydantic validates every value)."""
        # lazy: torch loads with the training modules, kept out of --help
        from training.config import TrainConfig
        from training.factory import parse_model_args

        values = dataclasses.asdict(self)
        del values["metrics_port"]
        values["model_args"] = parse_model_args(self.model_args)
        values["patience"] = None if self.patience == "0" else self.patience
        return TrainConfig(**values)


@options_command(TrainOptions)
def train_command(options: TrainOptions) -> None:
    """Train a skew-balanced model (built-in family or your own factory) and write an artifact directory.

    Docs: docs/training.md"""
    # lazy: pydantic and torch (with the training modules), kept out of --help
    from pydantic import ValidationError

    from training.errors import ModelError, TrainingError
    from training.launch import train
    from training.metrics_export import PORT_ENV

    if options.metrics_port is not None:
        os.environ[PORT_ENV] = str(options.metrics_port)  # every rank inherits it through torchrun
    setup_logging(False)
    try:
        cfg = options.config()
    except ValidationError as exc:
        error(first_error(exc))
        raise typer.Exit(2) from exc
    except ModelError as exc:  # a --model-arg that is not KEY=VALUE
        error(exc)
        raise typer.Exit(2) from exc
    try:
        meta = train(cfg)
    except (TrainingError, ValueError, RuntimeError) as exc:
        error(exc)
        raise typer.Exit(1) from exc
    if not meta:  # several nodes, each with its own --out: global rank 0 ran on another node
        console.print(
            f"training finished; global rank 0 ran on another node and wrote the artifact to its {cfg.out_dir}"
        )
        return
    print_training_summary(meta, cfg.out_dir)


def print_training_summary(meta: dict[str, Any], out: Path) -> None:
    """The artifact's place, its metrics per split, and how the run went."""
    say(f"artifact {out}")
    table = Table()
    table.add_column("split")
    for col in ("balanced acc", "macro-F1", "accuracy"):
        table.add_column(col, justify="right")
    for split, m in meta["metrics"].items():
        table.add_row(split, f"{m['balanced_accuracy']:.4f}", f"{m['macro_f1']:.4f}", f"{m['accuracy']:.4f}")
    console.print(table)
    prov = meta["provenance"]
    # Epochs count from 1, as the progress lines do.
    if prov.get("weights_from") == "best epoch":
        kept = f"kept epoch {prov['best_epoch'] + 1}, the best on smoothed val balanced accuracy"
    else:
        kept = f"kept the final epoch's weights ({prov['epochs_run']})"
    say(
        f"epochs {prov['epochs_run']} ({kept}), world size {prov['world_size']}, "
        f"mean epoch {prov['mean_epoch_wall_s'] * 1000:.0f} ms, mean rank imbalance {prov['mean_imbalance_ratio']:.2f}"
    )
