"""The `skewserve` command: data -> train -> export -> serve (Triton + gateway) -> load test.

Heavy imports (torch, onnx, grpc) happen inside each command so `skewserve --help` stays instant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from skewserve.output import console, error, notice, say, text

# Help is plain text, never Rich markup: help strings such as "train/val[/test]" must print as
# written (with markup on, newer typer/rich releases crash on them: MarkupError '[/test]').
HELP_MARKUP = None

app = typer.Typer(
    help=(
        "skewserve: train on skewed data, compile for NVIDIA Triton, serve across regions under skewed load.\n\n"
        "Flow: `data synth` -> `train` -> `export` -> `triton up` / `gateway` / `up` -> `loadtest`; "
        "`demo` runs it all end to end."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)
triton_app = typer.Typer(
    help="Run real tritonserver processes locally (CPU profile).",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(triton_app, name="triton")
gateway_app = typer.Typer(
    help="The multi-region KServe v2 gateway (HTTP + gRPC).",
    invoke_without_command=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(gateway_app, name="gateway")
data_app = typer.Typer(
    help="Data sets: generate long-tailed data, inspect class balance.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(data_app, name="data")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # The command prints what export and rollout did, once, for people; their INFO log lines
        # (for services and logs) would say it a second time.
        logging.getLogger("exporter").setLevel(logging.WARNING)


def wait_for_interrupt(check: Any = None) -> None:
    """Block the foreground until Ctrl-C or SIGTERM; `check()` runs every half second and may raise."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            if check is not None:
                check()
    except KeyboardInterrupt:
        pass


class StackDied(RuntimeError):
    """A process of the local stack exited on its own."""


def watch_stack(stack: Any) -> None:
    """Raise StackDied when the gateway or a (non-autoscaled) Triton server of `up` has exited."""
    proc = stack.gateway_proc
    if proc is not None and proc.poll() is not None:
        raise StackDied(f"the gateway exited with code {proc.returncode}; see {stack.log_dir}/gateway.log")
    for server in stack.fleet.servers:
        if server.pid is not None and not server.is_running():
            raise StackDied(f"tritonserver {server.spec.name} exited; see its log in {stack.log_dir}")


def loaded_models(stack: Any) -> dict[str, list[str]]:
    """Models each Triton server of the stack has loaded (statistics API: the repository API
    answers only the controller)."""
    from controller.triton_admin import TritonAdmin

    out: dict[str, list[str]] = {}
    for server in stack.fleet.servers:
        admin = TritonAdmin(server.spec.name, server.http_address, "", 10.0)
        try:
            out[server.spec.name] = sorted(admin.loaded())
        finally:
            admin.close()
    return out


@triton_app.command("up")
def triton_up(
    repo: Path = typer.Option(Path("model_repository"), "--repo", help="Triton model repository."),
    regions: str = typer.Option(
        "local", "--regions", help="Comma-separated region names, e.g. us-east,eu-west."
    ),
    per_region: int = typer.Option(1, "--per-region", min=1, help="Servers per region."),
    config_name: str = typer.Option(
        "local", "--model-config-name", help="Config profile: configs/<name>.pbtxt ('' for config.pbtxt)."
    ),
    control_mode: str = typer.Option("none", "--model-control-mode", help="none | poll | explicit."),
    response_cache_mb: int = typer.Option(
        0,
        "--response-cache-mb",
        min=0,
        help="Triton's own response cache per server, in MiB (0: off). Models opt in with "
        "`skewserve export --response-cache`; hits show as nv_cache_num_hits_per_model.",
    ),
    log_dir: Path = typer.Option(Path("runs/triton-logs"), "--log-dir"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Start tritonserver processes per region on REPO, print their endpoints, stop them on Ctrl-C."""
    from skewserve.errors import SkewserveError
    from skewserve.triton_process import TritonFleet, response_cache_config

    _setup_logging(verbose)
    region_list = [r.strip() for r in regions.split(",") if r.strip()]
    if not region_list:
        raise typer.BadParameter(
            "give at least one region name, e.g. --regions us-east,eu-west", param_hint="--regions"
        )
    try:
        fleet = TritonFleet.for_regions(
            repo,
            region_list,
            per_region,
            log_dir,
            model_config_name=config_name or None,
            model_control_mode=control_mode,
            cache_config=response_cache_config(response_cache_mb),
        )
        with console.status(f"starting {len(fleet.servers)} tritonserver process(es)"):
            fleet.start()
    except (SkewserveError, ValueError) as exc:
        error(exc)
        raise typer.Exit(1) from exc
    table = Table(title="tritonserver endpoints")
    for col in ("region", "server", "http", "grpc", "metrics", "pid"):
        table.add_column(col, no_wrap=True)
    for s in fleet.servers:
        table.add_row(
            *map(text, (s.spec.region, s.spec.name, s.http_url, s.grpc_address, s.metrics_url, s.pid))
        )
    console.print(table)
    say(f"logs: {log_dir}")
    say("serving; press Ctrl-C to stop")
    try:
        wait_for_interrupt()
    finally:
        fleet.stop()
        say("stopped all servers")


@data_app.command("synth")
def data_synth(
    out: Path = typer.Option(Path("runs/data"), "--out", help="Directory for train/val/test .parquet."),
    classes: int = typer.Option(10, "--classes", min=2),
    imbalance_ratio: float = typer.Option(100.0, "--imbalance-ratio", help="max/min training class count."),
    n_max: int = typer.Option(2000, "--n-max", help="Training rows of the largest class."),
    features: int = typer.Option(16, "--features", min=1),
    informative: int = typer.Option(8, "--informative", min=1),
    label_noise: float = typer.Option(0.0, "--label-noise"),
    covariate_shift: float = typer.Option(
        0.0, "--covariate-shift", help="Test-split feature shift, in std units."
    ),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Write a reproducible long-tailed data set (balanced val/test, as in the long-tail protocol)."""
    from pydantic import ValidationError

    from training.synth import SynthSpec, write

    try:
        spec = SynthSpec(
            n_classes=classes,
            imbalance_ratio=imbalance_ratio,
            n_max=n_max,
            n_features=features,
            n_informative=informative,
            label_noise=label_noise,
            covariate_shift=covariate_shift,
            seed=seed,
        )
    except ValidationError as exc:
        error(exc.errors()[0]["msg"])
        raise typer.Exit(2) from exc
    paths = write(spec, out)
    sizes = spec.class_sizes()
    say(f"wrote {', '.join(str(p) for p in paths.values())}")
    say(f"training class sizes: {sizes} (ratio {sizes[0] / sizes[-1]:.0f})")


@data_app.command("digits")
def data_digits(
    out: Path = typer.Option(
        Path("runs/digits"), "--out", help="Directory for train/val/test image folders."
    ),
    imbalance_ratio: float = typer.Option(50.0, "--imbalance-ratio", help="max/min training class count."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """scikit-learn's digits (8x8, shipped with it) as long-tailed PNG class folders, CIFAR-LT style."""
    from training.datasets_builtin import write_digits_lt

    counts = write_digits_lt(out, imbalance_ratio, seed=seed)
    say(f"wrote {out}/train, val, test (PNG, one folder per class)")
    say(f"training class sizes: {sorted(counts['train'], reverse=True)}; val and test balanced")


@data_app.command("topics")
def data_topics(
    out: Path = typer.Option(
        Path("runs/topics"), "--out", help="Directory for train/val/test tensor shards."
    ),
    imbalance_ratio: float = typer.Option(20.0, "--imbalance-ratio", help="max/min training class count."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Generated long-tailed topic classification text as token-id shards with vocab.txt."""
    from training.datasets_builtin import write_topics_lt

    sizes = write_topics_lt(out, ratio=imbalance_ratio, seed=seed)
    say(f"wrote {out}/train, val, test (tokens.npy, tokens.lengths.npy, labels.npy), vocab.txt, classes.txt")
    say(f"training class sizes: {sizes['train']}; val and test balanced")


@data_app.command("inspect")
def data_inspect(
    data: Path = typer.Option(..., "--data", help="Directory with train/val[/test] .parquet or .csv."),
    label: str = typer.Option("label", "--label"),
    val_fraction: float | None = typer.Option(
        None, "--val-fraction", help="Tables without a val file: split this share of each class off train."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the --val-fraction split (as `train --seed`)."),
) -> None:
    """Validate a data set as training would, and show each split's class counts and imbalance."""
    import numpy as np

    from training.data_source import open_data
    from training.errors import DataError

    try:
        ds = open_data(data, label, val_fraction=val_fraction, seed=seed)
    except DataError as exc:
        error(exc)
        raise typer.Exit(1) from exc
    splits = ds.splits()
    # A line of its own, not the table's title: a title wraps to the table's width and cuts the path.
    inputs = ", ".join(f"{i.name} {i.dtype} {list(i.shape)}" for i in ds.spec.inputs)
    if ds.spec.kind == "table":
        say(f"{data}: {ds.spec.inputs[0].shape[0]} features, {len(ds.classes)} classes")
    else:
        say(f"{data}: {ds.spec.kind}, inputs {inputs}, {len(ds.classes)} classes")
    table = Table()
    table.add_column("class")
    for name in splits:
        table.add_column(name, justify="right")
    counts = {name: np.bincount(split.labels, minlength=len(ds.classes)) for name, split in splits.items()}
    for i, cls in enumerate(ds.classes):
        table.add_row(text(cls), *(str(int(c[i])) for c in counts.values()))
    console.print(table)
    for note in ds.warnings:
        notice(note, "warning")
    train = counts["train"]
    say(
        f"training imbalance ratio (largest/smallest class): {train.max() / max(1, train.min()):.1f}; data hash {ds.data_hash[:12]}"
    )


@app.command("train")
def train_command(
    data: Path = typer.Option(
        ...,
        "--data",
        help="Directory with train/val[/test] .parquet or .csv. Or image folders (train/<class>/<images>) "
        "or tensor shards (train/labels.npy + <input>.npy); README, 'Bring your own data'.",
    ),
    out: Path = typer.Option(Path("runs/artifact"), "--out", help="Artifact directory (checkpoints inside)."),
    label: str = typer.Option("label", "--label"),
    model: str = typer.Option(
        "mlp",
        "--model",
        help="Built-in family (mlp: tables; cnn: images; text: token ids) or your own MODULE:FACTORY "
        "(or path/to/file.py:FACTORY); README, 'Your own model'.",
    ),
    model_arg: list[str] = typer.Option(
        [], "--model-arg", help="KEY=VALUE passed to the model factory (repeatable), e.g. width=64."
    ),
    image_size: int | None = typer.Option(
        None, "--image-size", min=1, help="Images: resize to SIZE x SIZE (default: the most common size)."
    ),
    channels: int | None = typer.Option(
        None, "--channels", help="Images: 1 (grey) or 3 (RGB); default: 1 if all grey."
    ),
    augment: bool = typer.Option(
        True, "--augment/--no-augment", help="Images: random-shift augmentation in training."
    ),
    skip_bad_files: bool = typer.Option(
        False, "--skip-bad-files", help="Images: skip (and count) unreadable files instead of failing."
    ),
    val_fraction: float | None = typer.Option(
        None,
        "--val-fraction",
        help="Tables without val.csv/.parquet: split this share of each class off train (stratified, by --seed).",
    ),
    data_workers: str = typer.Option(
        "auto",
        "--data-workers",
        help="DataLoader workers per rank; auto: 0 for tables, else min(4, cores/rank).",
    ),
    nproc: int = typer.Option(
        1, "--nproc", min=1, help="Ranks per node; >1 launches torchrun (gloo on CPU, NCCL on CUDA)."
    ),
    nnodes: int = typer.Option(
        1, "--nnodes", min=1, help="Nodes; run this command on each with the same flags."
    ),
    node_rank: int | None = typer.Option(
        None, "--node-rank", min=0, help="This node's rank (only with --rdzv-backend static)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="host:port of the rendezvous (one node's address), same on every node."
    ),
    rdzv_id: str = typer.Option("skewserve", "--rdzv-id", help="Job id shared by every node of one run."),
    rdzv_backend: str = typer.Option(
        "c10d", "--rdzv-backend", help="c10d (ranks assigned at rendezvous) | static."
    ),
    local_addr: str | None = typer.Option(
        None, "--local-addr", help="Address other nodes reach this node at (default: its hostname)."
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        min=0,
        help="Elastic restarts of the job; restarted workers resume from the checkpoint.",
    ),
    device: str = typer.Option(
        "auto", "--device", help="auto (CUDA GPU LOCAL_RANK when visible) | cpu | cuda."
    ),
    loss: str = typer.Option(
        "logit_adjusted",
        "--loss",
        help="ce | weighted_ce | effective_ce | focal | logit_adjusted | balanced_softmax",
    ),
    sampler_q: float = typer.Option(
        1.0, "--sampler-q", help="Class draw probability ∝ n_c^q (1 natural, 0 class-uniform)."
    ),
    epochs: int | None = typer.Option(
        None, "--epochs", min=1, help="Train exactly this many epochs instead of the step budget."
    ),
    max_steps: int | None = typer.Option(
        None, "--max-steps", min=1, help="Optimizer-step budget (default: max(--min-steps, 30 epochs))."
    ),
    min_steps: int = typer.Option(1000, "--min-steps", min=1, help="Floor of the automatic step budget."),
    input_noise: str = typer.Option(
        "auto",
        "--input-noise",
        help="Gaussian input noise in feature stds; auto: min(1.5, 3*sqrt(features/rows)).",
    ),
    checkpoint_every_steps: int = typer.Option(
        25, "--checkpoint-every-steps", min=1, help="Checkpoint at the first epoch end after this many steps."
    ),
    batch_size: int = typer.Option(256, "--batch-size", help="Global batch size across ranks."),
    lr: float = typer.Option(3e-3, "--lr"),
    width: int = typer.Option(128, "--width"),
    depth: int = typer.Option(2, "--depth"),
    dropout: float = typer.Option(0.1, "--dropout"),
    precision: str = typer.Option(
        "auto",
        "--precision",
        help="auto (bf16 on GPUs that support it, else fp16; fp32 on CPU) | fp32 | bf16 | fp16 (CUDA, with a gradient scaler)",
    ),
    patience: str = typer.Option(
        "auto",
        "--patience",
        help="Early-stopping patience in steps on smoothed val balanced accuracy; auto adapts; 0 disables.",
    ),
    speed_balance: bool = typer.Option(
        True, "--speed-balance/--no-speed-balance", help="Re-split each global batch by rank throughput."
    ),
    slow_rank: int | None = typer.Option(
        None, "--slow-rank", help="Slow this rank down (reproduces a mixed fleet)."
    ),
    slow_factor: float = typer.Option(1.0, "--slow-factor", help="How many times slower --slow-rank runs."),
    seed: int = typer.Option(0, "--seed"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoints/last.pt."),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        min=1,
        max=65535,
        help="Serve live Prometheus metrics per rank on 127.0.0.1:PORT+rank (throughput, data and "
        "all-reduce waits, imbalance, gradient norm).",
    ),
) -> None:
    """Train a skew-balanced model (built-in family or your own factory) and write an artifact directory."""
    from pydantic import ValidationError

    if metrics_port is not None:
        from training.metrics_export import PORT_ENV

        os.environ[PORT_ENV] = str(metrics_port)  # every rank inherits it through torchrun

    from training.config import TrainConfig
    from training.errors import TrainingError
    from training.factory import parse_model_args
    from training.launch import train

    _setup_logging(False)
    try:
        cfg = TrainConfig(
            data_dir=data,
            out_dir=out,
            label_column=label,
            model=model,
            model_args=parse_model_args(model_arg),
            image_size=image_size,
            channels=channels,
            augment=augment,
            skip_bad_files=skip_bad_files,
            val_fraction=val_fraction,
            data_workers=data_workers,  # type: ignore[arg-type]  # "auto" or a count, pydantic validates
            nproc=nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id,
            rdzv_backend=rdzv_backend,  # type: ignore[arg-type]  # pydantic validates the choice
            local_addr=local_addr,
            max_restarts=max_restarts,
            device=device,  # type: ignore[arg-type]  # pydantic validates the choice
            loss=loss,  # type: ignore[arg-type]  # pydantic validates the choice
            sampler_q=sampler_q,
            epochs=epochs,
            max_steps=max_steps,
            min_steps=min_steps,
            checkpoint_every_steps=checkpoint_every_steps,
            input_noise=input_noise,  # type: ignore[arg-type]  # "auto" or a number, pydantic validates
            global_batch_size=batch_size,
            lr=lr,
            width=width,
            depth=depth,
            dropout=dropout,
            precision=precision,  # type: ignore[arg-type]  # pydantic validates the choice
            patience=None if patience == "0" else patience,  # type: ignore[arg-type]  # "auto" or steps
            speed_balance=speed_balance,  # type: ignore[arg-type]
            slow_rank=slow_rank,
            slow_factor=slow_factor,
            seed=seed,
            resume=resume,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        error(f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}")
        raise typer.Exit(2) from exc
    try:
        meta = train(cfg)
    except (TrainingError, ValueError, RuntimeError) as exc:
        error(exc)
        raise typer.Exit(1) from exc
    if not meta:  # several nodes, each with its own --out: global rank 0 ran on another node
        console.print(
            f"training finished; global rank 0 ran on another node and wrote the artifact to its {out}"
        )
        return
    print_training_summary(meta, out)


def print_training_summary(meta: dict, out: Path) -> None:
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


@app.command("export")
def export_command(
    artifact: Path = typer.Option(..., "--artifact", help="Artifact directory written by `skewserve train`."),
    repo: str = typer.Option(
        "model_repository",
        "--repo",
        help="Triton model repository: a folder, or s3://BUCKET/PREFIX (endpoint from AWS_ENDPOINT_URL_S3).",
    ),
    name: str = typer.Option(..., "--name", help="Model name (folder and URL part)."),
    version: int | None = typer.Option(
        None, "--version", help="Version to publish; default max+1. Never overwrites."
    ),
    precision: str = typer.Option("fp32", "--precision", help="fp32 | fp16 (FP32 at the boundary)."),
    tensorrt: str = typer.Option("auto", "--tensorrt", help="auto | on | off: TensorRT plan on a CUDA GPU."),
    max_batch: int = typer.Option(
        64, "--max-batch", min=1, help="Triton max_batch_size and parity batch range."
    ),
    response_cache: bool = typer.Option(
        False, "--response-cache", help="Enable Triton's response cache in both configs (GPU and local)."
    ),
    fmt: str = typer.Option(
        "onnx", "--format", help="onnx (onnxruntime / TensorRT) | torchscript (pytorch_libtorch)."
    ),
    change_backend: bool = typer.Option(
        False, "--change-backend", help="Allow this version to change the model's serving backend."
    ),
    keep_versions: int = typer.Option(
        2,
        "--keep-versions",
        min=1,
        help="Unused since desired state: servers load the promoted version (skewserve rollout); "
        "old versions are removed by the controller (skewserve controller --keep-versions).",
    ),
    ort_tensorrt: str = typer.Option(
        "off", "--ort-tensorrt", help="off | fp32 | fp16: onnxruntime's TensorRT accelerator on GPU servers."
    ),
    ort_tensorrt_cache_dir: str = typer.Option(
        "/tmp/skewserve-ort-trt-cache", "--ort-tensorrt-cache-dir", help="Engine cache folder on the servers."
    ),
    trt_version_compatible: bool = typer.Option(
        False, "--trt-version-compatible", help="Plans that also load on later TensorRT of the same major."
    ),
    trt_hardware_compatibility: str = typer.Option(
        "none", "--trt-hardware-compatibility", help="none | ampere_plus: one plan for every 8.0+ GPU."
    ),
    trt_tf32: bool = typer.Option(
        False, "--trt-tf32", help="Allow TF32 in FP32 plans (parity limit 5e-3 instead of 1e-4)."
    ),
) -> None:
    """Compile an artifact to ONNX (+ TensorRT on GPU) or TorchScript, check parity, publish a new immutable version."""
    from pydantic import ValidationError

    from exporter.errors import ExportError
    from exporter.pipeline import export_artifact
    from exporter.tensorrt_build import TensorRTOptions
    from exporter.triton_config import ConfigOptions

    try:
        config_options = ConfigOptions(
            max_batch_size=max_batch,
            response_cache=response_cache,
            keep_versions=keep_versions,
            ort_tensorrt=ort_tensorrt,  # type: ignore[arg-type]
            ort_tensorrt_cache_dir=ort_tensorrt_cache_dir,
        )
        trt_options = TensorRTOptions(
            version_compatible=trt_version_compatible,
            hardware_compatibility=trt_hardware_compatibility,  # type: ignore[arg-type]
            tf32=trt_tf32,
        )
    except ValidationError as exc:
        bad = exc.errors()[0]
        raise typer.BadParameter(f"{bad['loc'][0]}: {bad['msg']}") from exc

    _setup_logging(False)
    # onnx_ir and onnxscript's optimizer log each graph rewrite at INFO: noise for a person exporting.
    for noisy in ("onnx_ir", "onnxscript"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        with console.status(text(f"exporting {artifact} as {name}")):
            result = export_artifact(
                artifact,
                repo if repo.startswith("s3://") else Path(repo),
                name,
                version=version,
                precision=precision,
                tensorrt=tensorrt,
                options=config_options,
                fmt=fmt,
                trt_options=trt_options,
                change_backend=change_backend,
            )
    except (ExportError, FileNotFoundError, ValueError) as exc:
        error(exc)
        raise typer.Exit(1) from exc
    for line in result.notices:
        notice(line)
    for report in result.parity:
        say(f"parity {report.summary()}")
    where = (
        f"{repo.rstrip('/')}/{name}/{result.published.version}"
        if repo.startswith("s3://")
        else result.published.path
    )
    say(f"published {result.published.name} version {result.published.version} at {where}")
    for raw in result.raw_models:
        say(f"published {raw.name} version {raw.version} at {raw.path}")
    if result.raw_models:
        say(
            f"raw inputs: call {name}_raw with input 'raw' (BYTES, one encoded image or UTF-8 text per row); "
            f"{name} takes tensors"
        )


ServersOpt = typer.Option(
    None, "--servers", help="Comma-separated Triton HTTP URLs (explicit model-control mode)."
)
RegionsOpt = typer.Option(None, "--regions", help="Only these regions of --config.")
ConfigOpt = typer.Option(
    None,
    "--config",
    help="The stack config `skewserve up` runs (its servers and control key are read from the running "
    "stack's --log-dir), or a gateway config (static servers and discovered regions); every region "
    "unless --regions.",
)
LogDirOpt = typer.Option(
    Path("runs/stack-logs"), "--log-dir", help="The running stack's --log-dir (with a stack --config)."
)
RepoOpt = typer.Option(
    None,
    "--repo",
    help="The model repository: folder or s3://... (default: the stack config's repository, else "
    "model_repository)",
)


@contextlib.contextmanager
def control_targets(
    servers: str | None,
    regions: str | None,
    config: Path | None,
    log_dir: Path,
    repo: str | None,
    label: str,
) -> Iterator[tuple[Any, Any, str]]:
    """(state store, servers callable, control key) for the control commands; discovery runs while
    the block does, so servers that appear mid-rollout are found."""
    from controller.fleet import ControlledServer
    from controller.rollout import static_servers
    from controller.runner import ControllerThread
    from controller.state_store import open_store

    urls = [u.strip() for u in (servers or "").split(",") if u.strip()]
    if regions and config is None:
        raise typer.BadParameter(
            "--regions needs --config (the stack or gateway config naming the servers)",
            param_hint="--regions",
        )
    key = os.environ.get("SKEWSERVE_CONTROL_KEY", "")
    thread = None
    found: Any = static_servers(urls)
    if config is not None:
        try:
            gw, stack_repo, stack_key = rollout_targets(config, log_dir)
        except ValueError as exc:
            error(exc, label=label)
            raise typer.Exit(2) from exc
        names = {r.name for r in gw.regions}
        wanted = {r.strip() for r in regions.split(",") if r.strip()} if regions else names
        unknown = wanted - names
        if unknown:
            raise typer.BadParameter(f"regions {sorted(unknown)} are not in {config}", param_hint="--regions")
        repo = repo or stack_repo
        key = key or stack_key
        thread = ControllerThread(
            gw, open_store(repo or "model_repository"), key, regions=wanted, reconcile=False
        )
        thread.start()
        static = static_servers(urls)

        def found() -> list[ControlledServer]:
            return static() + thread.servers()

    elif not urls:
        raise typer.BadParameter(
            "give --servers URL,... or --config (with --regions)", param_hint="--servers"
        )
    try:
        yield open_store(repo or "model_repository"), found, key
    finally:
        if thread is not None:
            thread.stop()


@app.command("rollout")
def rollout_command(
    name: str = typer.Argument(..., help="Model name."),
    version: int = typer.Option(..., "--version", help="Published version to roll out."),
    servers: str | None = ServersOpt,
    regions: str | None = RegionsOpt,
    config: Path | None = ConfigOpt,
    log_dir: Path = LogDirOpt,
    repo: str | None = RepoOpt,
    load_timeout: float = typer.Option(300.0, "--load-timeout", help="Seconds one load may take."),
    server_tensorrt: str | None = typer.Option(
        None, "--server-tensorrt", help="TensorRT version of the servers, when not the pinned Triton image's."
    ),
    gpu_capability: str | None = typer.Option(
        None,
        "--gpu-capability",
        help="Compute capabilities of the servers' GPUs, e.g. 8.6,9.0 (TensorRT plans).",
    ),
    version_compatible: bool = typer.Option(
        False,
        "--servers-version-compatible",
        help="The servers run with --backend-config=tensorrt,version-compatible=true.",
    ),
    share: float = typer.Option(
        0.0, "--share", min=0.0, max=1.0, help="Share of clients (sticky per client key) the canary answers."
    ),
    shadow: float = typer.Option(
        0.0,
        "--shadow",
        min=0.0,
        max=1.0,
        help="Share of requests mirrored to the canary (stratified by class; answers never returned).",
    ),
    min_requests: int = typer.Option(
        100, "--min-requests", min=1, help="Gate: canary/mirrored answers first."
    ),
    min_per_class: int = typer.Option(20, "--min-per-class", min=1, help="Gate: mirrored answers per class."),
    agreement: float = typer.Option(
        0.95, "--agreement", min=0.0, max=1.0, help="Gate: least agreement per class."
    ),
    max_error_rate: float = typer.Option(
        0.01, "--max-error-rate", min=0.0, max=1.0, help="Gate: errors above the stable version's rate."
    ),
    max_p99_ratio: float = typer.Option(
        1.5, "--max-p99-ratio", min=0.01, help="Gate: p99 over the stable's."
    ),
    gate_wait: float = typer.Option(
        900.0, "--gate-wait", min=1.0, help="Gate: seconds after which classes short of samples go unjudged."
    ),
    wait: float = typer.Option(
        0.0, "--wait", min=0.0, help="With --share/--shadow: seconds to wait for the controller's verdict."
    ),
    canary_regions: str | None = typer.Option(
        None,
        "--canary-regions",
        help="Regions whose servers must all pass before promotion, kept in the canary record so every "
        "region's controller holds it; default with --config: every region the config names.",
    ),
) -> None:
    """Canary a published version on every server (one by one), then promote it in the model's
    desired state; on a failure every server goes back to the promoted version. With --share or
    --shadow, the running controller promotes it once the gateways' traffic passes its gate; with
    several regions, once every region's controller found all its servers passed."""
    from controller.config import ControllerConfig
    from controller.desired_state import TrafficGate
    from controller.errors import RolloutError
    from controller.rollout import rollout

    _setup_logging(False)
    cfg = ControllerConfig(
        load_timeout_s=load_timeout,
        interval_s=1.0,
        server_tensorrt=server_tensorrt,
        gpu_capabilities=tuple(c.strip() for c in (gpu_capability or "").split(",") if c.strip()),
        servers_version_compatible=version_compatible,
    )
    with control_targets(servers, regions, config, log_dir, repo, "rollout failed") as (store, found, key):
        try:
            gate = TrafficGate(
                min_requests=min_requests,
                min_per_class=min_per_class,
                agreement=agreement,
                max_error_rate=max_error_rate,
                max_p99_ratio=max_p99_ratio,
                max_wait_s=gate_wait,
            )
            result = rollout(
                store,
                name,
                version,
                found,
                key,
                cfg,
                share,
                shadow,
                gate,
                wait,
                regions=rollout_regions(canary_regions, config, log_dir),
            )
        except (RolloutError, ValueError) as exc:
            error(exc, label="rollout failed")
            raise typer.Exit(1) from exc
    for step in result.steps:
        say(step)
    canary = result.state.canary
    pending = sorted(set(canary.regions) - set(canary.regions_done)) if canary is not None else []
    if result.observing and pending and not (share or shadow):
        say(
            f"{name} version {version} passed its check on every server found here; it is promoted once "
            f"the controllers of {', '.join(pending)} find all their servers passed "
            f"(see `skewserve canary {name}`); a region whose controller is down holds it"
        )
        return
    if result.observing:
        say(
            f"{name} version {version} passed its check on every server; it answers {share:.0%} of clients "
            f"and {shadow:.0%} of requests are mirrored to it; the running controller promotes it once "
            f"the traffic gate passes (see `skewserve canary {name}`)"
        )
        return
    say(f"{name} version {version} promoted; served: {', '.join(map(str, result.state.served))}")


@app.command("rollback")
def rollback_command(
    name: str = typer.Argument(..., help="Model name."),
    to: int | None = typer.Option(None, "--to", help="Version to serve (default: the newest retired one)."),
    servers: str | None = ServersOpt,
    regions: str | None = RegionsOpt,
    config: Path | None = ConfigOpt,
    log_dir: Path = LogDirOpt,
    repo: str | None = RepoOpt,
) -> None:
    """Serve an earlier version again: a change of desired state, applied to the servers found now
    and by every controller from then on (it survives restarts)."""
    from controller.errors import RolloutError
    from controller.rollout import rollback

    _setup_logging(False)
    with control_targets(servers, regions, config, log_dir, repo, "rollback failed") as (store, found, key):
        try:
            state = rollback(store, name, to, found, key)
        except RolloutError as exc:
            error(exc, label="rollback failed")
            raise typer.Exit(1) from exc
    say(
        f"{name} serves version(s) {', '.join(map(str, state.served))} (desired state generation {state.generation})"
    )


@app.command("state")
def state_command(
    name: str | None = typer.Argument(None, help="Model name (default: every model)."),
    repo: str = typer.Option("model_repository", "--repo", help="Folder or s3://..."),
) -> None:
    """Print models' desired state: served versions, canary, each version's state, load failures."""
    from controller.rollout import STORE_ERRORS
    from controller.state_store import open_store

    try:
        store = open_store(repo)
        for model in [name] if name else store.models():
            state = store.current(model)
            if state is None:
                error(ValueError(f"{model} is not published in {repo}"), label="state")
                raise typer.Exit(1)
            print(state.to_json(), end="")
    except STORE_ERRORS as exc:
        error(exc, label="state")
        raise typer.Exit(1) from exc


@app.command("canary")
def canary_command(
    name: str = typer.Argument(..., help="Model name."),
    repo: str = typer.Option("model_repository", "--repo", help="Folder or s3://..."),
) -> None:
    """Print a model's canary: version, traffic share, shadow share, servers passed, and the traffic
    gate's latest reading (per-class agreement of shadow answers, errors, p99)."""
    from controller.rollout import STORE_ERRORS
    from controller.state_store import open_store

    try:
        state = open_store(repo).current(name)
    except STORE_ERRORS as exc:
        error(exc, label="canary")
        raise typer.Exit(1) from exc
    if state is None:
        error(ValueError(f"{name} is not published in {repo}"), label="canary")
        raise typer.Exit(1)
    canary = state.canary
    if canary is None:
        last = max((v for v, r in state.versions.items() if r.state in ("promoted", "failed")), default=None)
        tail = (
            ""
            if last is None
            else f"; version {last}: {state.versions[last].state} ({state.versions[last].reason})"
        )
        print(f"{name}: no canary; served: {', '.join(map(str, state.served))}{tail}")
        return
    print(
        f"{name}: version {canary.version} in canary beside {', '.join(map(str, state.served))}; "
        f"share {canary.share:.0%}, shadow {canary.shadow:.0%}; passed on {len(canary.passed)} servers"
    )
    if canary.report:
        print(canary.report)


@app.command("controller")
def controller_command(
    config: Path = typer.Option(
        ..., "--config", help="Gateway config naming the servers (static or discovered)."
    ),
    repo: str = typer.Option(..., "--repo", help="The model repository: folder or s3://..."),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between reconcile passes."),
    load_timeout: float = typer.Option(
        300.0, "--load-timeout", help="Seconds one load may take (the servers' start-up budget)."
    ),
    keep_versions: int = typer.Option(
        3, "--keep-versions", help="Published versions kept beside the served ones."
    ),
    regions: str | None = typer.Option(
        None, "--regions", help="Only these regions' servers (default: every region of --config)."
    ),
    canary_regions: str | None = typer.Option(
        None,
        "--canary-regions",
        help="Regions whose servers must all pass a canary before promotion (one controller per "
        "region: name every region); default: the regions this controller reconciles.",
    ),
    listen: str | None = typer.Option(
        None,
        "--listen",
        help="[HOST:]PORT of the controller's API for gateways: traffic of models in canary (the gateways' "
        "traffic.controller_url) and, with --placement, models no server holds (cold_start.controller_url); "
        "also /healthz, /readyz and /metrics. HOST defaults to 127.0.0.1; any other needs --tokens-dir.",
    ),
    tokens_dir: Path | None = typer.Option(
        None,
        "--tokens-dir",
        help="Directory of callers' bearer tokens (file name: caller, content: token; a mounted "
        "Kubernetes Secret): /v1/ calls without one of them are refused 401.",
    ),
    leader_election: bool = typer.Option(
        False,
        "--leader-election",
        help="Run as one of several replicas: only the holder of a lease in the repository reconciles; "
        "another takes over within about 1.33x the lease (15 s) after the leader dies.",
    ),
    placement: Path | None = typer.Option(
        None,
        "--placement",
        help="YAML of placement by demand (controller/placement.py: server_capacity_bytes, "
        "target_rps_per_copy, ...); unset: every server loads every model.",
    ),
    version_compatible: bool = typer.Option(
        False,
        "--servers-version-compatible",
        help="The servers run with --backend-config=tensorrt,version-compatible=true.",
    ),
    leader_lease: float = typer.Option(
        15.0, "--leader-lease", help="Seconds of the leader's lease (with --leader-election)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Reconcile every discovered Triton server onto each model's desired state, until stopped.
    The control key comes from SKEWSERVE_CONTROL_KEY (the servers' --http-restricted-api value)."""
    from controller.config import ControllerConfig
    from controller.fleet import fleet_config
    from controller.runner import ControllerThread
    from controller.state_store import open_store
    from controller.store_probe import check_conditional_writes
    from gateway.config import ConfigError

    _setup_logging(verbose)
    logging.getLogger("controller").setLevel(logging.INFO)
    try:
        gw = fleet_config(config)
        placement_cfg = None
        if placement is not None:
            import yaml

            from controller.placement import PlacementConfig

            placement_cfg = PlacementConfig.model_validate(yaml.safe_load(placement.read_text()))
        cfg = ControllerConfig(
            interval_s=interval,
            load_timeout_s=load_timeout,
            keep_versions=keep_versions,
            servers_version_compatible=version_compatible,
            placement=placement_cfg,
            canary_regions=tuple(r.strip() for r in (canary_regions or "").split(",") if r.strip()),
            leader_lease_s=leader_lease,
        )
    except (ConfigError, ValueError, OSError) as exc:
        error(exc, label="controller")
        raise typer.Exit(2) from exc
    key = os.environ.get("SKEWSERVE_CONTROL_KEY", "")
    if not key:
        say(
            "SKEWSERVE_CONTROL_KEY is not set: loads go out without a key (servers must not restrict the API)"
        )
    wanted = {r.strip() for r in regions.split(",") if r.strip()} if regions else None
    unknown = (wanted or set()) - {r.name for r in gw.regions}
    if unknown:
        error(ValueError(f"regions {sorted(unknown)} are not in {config}"), label="controller")
        raise typer.Exit(2)
    tokens = None
    host, _, port = (listen or "").rpartition(":")
    host = host or "127.0.0.1"
    if listen:
        try:
            tokens = controller_tokens(host, tokens_dir)
        except ValueError as exc:
            error(exc, label="controller")
            raise typer.Exit(2) from exc
    store = open_store(repo)
    try:
        check_conditional_writes(store)
    except Exception as exc:  # unsafe, unreachable or unwritable: the controller must not act on it
        error(ValueError(f"model repository {repo}: {exc}"), label="controller")
        raise typer.Exit(2) from exc
    thread = ControllerThread(gw, store, key, cfg, regions=wanted, leader_election=leader_election).start()
    if listen:
        try:
            bound = thread.serve_demand(host, int(port), tokens)
        except (ValueError, OSError) as exc:
            thread.stop()
            error(ValueError(f"--listen {listen}: {exc} (give [HOST:]PORT, a free port)"), label="controller")
            raise typer.Exit(2) from exc
        say(
            f"controller API on http://{host}:{bound}: /v1/traffic (gateways' traffic.controller_url)"
            + (", /v1/demand (cold_start.controller_url)" if placement_cfg is not None else "")
        )
    say(f"controller reconciling {repo} onto the servers of {config}; Ctrl-C stops it")
    try:
        wait_for_interrupt()
    finally:
        thread.stop()


def rollout_regions(canary_regions: str | None, config: Path | None, log_dir: Path) -> list[str] | None:
    """The regions a canary must pass: the option's, else every region of --config (a region whose
    controller is down then holds the canary), else none named (the servers given)."""
    if canary_regions is not None:
        return [r.strip() for r in canary_regions.split(",") if r.strip()]
    if config is None:
        return None
    gw, _, _ = rollout_targets(config, log_dir)
    return sorted(r.name for r in gw.regions)


def controller_tokens(host: str, tokens_dir: Path | None) -> Any:
    """The callers' tokens for the controller's API; ValueError when the API would be open beyond
    this machine without them."""
    from controller.api_auth import CallerTokens, is_loopback

    if tokens_dir is not None:
        return CallerTokens(tokens_dir)
    if not is_loopback(host):
        raise ValueError(
            f"--listen {host}: the controller's API would take traffic reports and load asks from "
            "anyone who reaches it; give --tokens-dir (one bearer token per caller) or listen on 127.0.0.1"
        )
    say("controller API without tokens: loopback only, every local process may call it")
    return None


def rollout_targets(config: Path, log_dir: Path) -> tuple[Any, str | None, str]:
    """The gateway config naming the servers (a running stack's generated one, or `config` itself),
    the stack's repository and control key; ValueError in one line saying what is wrong."""
    from controller.fleet import fleet_config
    from gateway.config import ConfigError
    from skewserve.stack import CONTROL_KEY_FILE, StackConfigError, load_stack_config

    if not config.is_file():
        raise ValueError(f"--config {config} does not exist")
    try:
        stack = load_stack_config(config)
    except (StackConfigError, TypeError, ValueError):
        stack = None
    key = ""
    if stack is not None:
        generated = log_dir / "gateway.generated.yaml"
        if not generated.is_file():
            raise ValueError(
                f"{config} is a stack config, but no stack is running with --log-dir {log_dir} "
                f"({generated} is missing): start it with `skewserve up --config {config}`, or pass its --log-dir"
            )
        gw_path, repository = generated, str(stack.repository)
        key_file = log_dir / CONTROL_KEY_FILE
        key = key_file.read_text().strip() if key_file.is_file() else ""
    else:
        gw_path, repository = config, None
    try:
        gw = fleet_config(gw_path)
    except ConfigError as exc:
        raise ValueError(f"{config} is neither a stack config nor a valid gateway config: {exc}") from exc
    return gw, repository, key


@gateway_app.callback()
def gateway_command(
    ctx: typer.Context,
    config: Path | None = typer.Option(
        None, "--config", help="Gateway config (YAML or TOML); env SKEWSERVE_GATEWAY_* overrides."
    ),
) -> None:
    """Run the gateway in front of the Triton servers named in --config."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        raise typer.BadParameter(
            "give --config FILE (see deploy/gateway.example.yaml)", param_hint="--config"
        )
    from gateway.config import ConfigError, load_gateway_config
    from gateway.fronts.listen import ListenError
    from gateway.operations.logs import configure_logging
    from gateway.server import run

    try:
        cfg = load_gateway_config(config)
    except ConfigError as exc:
        error(exc)
        raise typer.Exit(2) from exc
    configure_logging(cfg.log_json, cfg.log_level.upper())
    try:
        run(cfg, config_path=config)
    except ListenError as exc:
        from rich.markup import escape

        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from exc


KEY_IN_HISTORY_WARNING = (
    "a key given on the command line is saved in your shell history; "
    "omit it to type it at a hidden prompt or pipe it in: skewserve gateway hash-key < key.txt"
)


def read_key_from_stdin() -> str:
    """The API key on standard input: a hidden prompt on a terminal, else one line from the pipe."""
    if sys.stdin.isatty():
        return str(typer.prompt("API key", hide_input=True, err=True))
    data = sys.stdin.read()
    # `echo KEY |` and files end in a newline that is not part of the key.
    key = data[:-1] if data.endswith("\n") else data
    key = key[:-1] if key.endswith("\r") else key
    if "\n" in key:
        error(f"standard input holds {key.count(chr(10)) + 1} lines; give exactly one API key")
        raise typer.Exit(2)
    return key


@gateway_app.command("hash-key")
def hash_key_command(
    key: str | None = typer.Argument(
        None,
        help="The API key to hash for auth.keys[].sha256. Omit it to read the key from standard input "
        "(a hidden prompt on a terminal), which keeps it out of shell history.",
        show_default=False,
    ),
) -> None:
    """Print the SHA-256 to put in the config for an API key (the key itself is never stored)."""
    from gateway.state.auth import hash_key

    if key is not None:
        notice(KEY_IN_HISTORY_WARNING, label="warning", to_stderr=True)
    else:
        key = read_key_from_stdin()
    if not key:
        error("the API key is empty; pipe in a key or type one at the prompt")
        raise typer.Exit(2)
    # Only the digest goes to stdout, so `$(skewserve gateway hash-key < key.txt)` captures it alone.
    typer.echo(hash_key(key))


@app.command("up")
def up_command(
    config: Path = typer.Option(
        ..., "--config", help="Stack config: model repository, regions, gateway settings."
    ),
    log_dir: Path = typer.Option(Path("runs/stack-logs"), "--log-dir"),
    repo: Path | None = typer.Option(
        None,
        "--repo",
        help="Model repository to serve, overriding the config's `repository` (which is read relative "
        "to the config file's folder).",
    ),
    response_cache_mb: int | None = typer.Option(
        None,
        "--response-cache-mb",
        min=0,
        help="Triton's own response cache per server, in MiB (0: off); overrides the config's "
        "response_cache_mb. Models opt in with `skewserve export --response-cache`.",
    ),
    autoscale: bool = typer.Option(
        False,
        "--autoscale",
        help="Start and stop Triton servers per region on their load (the config's `autoscale` "
        "policy, else the default: 2 requests in flight per server, 1-4 servers, 60 s cool-down); "
        "the gateway follows them through DNS discovery.",
    ),
) -> None:
    """Start the Triton servers the config names (local CPU profile) and the gateway; Ctrl-C stops all."""
    from skewserve.errors import SkewserveError
    from skewserve.stack import LocalStack, StackConfigError, load_stack_config

    _setup_logging(False)
    try:
        stack_cfg = load_stack_config(config)
    except StackConfigError as exc:
        error(exc)
        raise typer.Exit(2) from exc
    if repo is not None:
        if not repo.is_dir():
            error(
                f"--repo {repo} is not a folder; export a model into it first (skewserve export --repo {repo})"
            )
            raise typer.Exit(2)
        stack_cfg = stack_cfg.model_copy(update={"repository": repo.resolve()})
    if response_cache_mb is not None:
        stack_cfg = stack_cfg.model_copy(update={"response_cache_mb": response_cache_mb})
    if autoscale and stack_cfg.autoscale is None:
        from skewserve.autoscale import AutoscalePolicy

        stack_cfg = stack_cfg.model_copy(update={"autoscale": AutoscalePolicy()})
    stack = LocalStack(stack_cfg, log_dir)
    try:
        with console.status("starting tritonserver processes and the gateway"):
            stack.start()
    except (SkewserveError, OSError, RuntimeError) as exc:
        stack.stop()
        error(exc)
        raise typer.Exit(1) from exc
    try:
        print_stack(stack)
        say(f"model repository {stack_cfg.repository}")
        models = sorted({m for names in loaded_models(stack).values() for m in names})
        if models:
            say(f"models loaded: {', '.join(models)}")
        else:
            notice(
                f"no model loaded from {stack_cfg.repository}: every request will be 'unknown model'. "
                "Export one there (skewserve export --repo ...) or pass --repo",
                "warning",
            )
        say("serving; press Ctrl-C to stop")
        wait_for_interrupt(lambda: watch_stack(stack))
    except StackDied as exc:
        error(f"{exc}; stopping every server of the stack")
        raise typer.Exit(1) from exc
    finally:
        stack.stop()
        say("stopped the gateway and all servers")


def print_stack(stack: Any) -> None:
    table = Table(title="skewserve local stack")
    for col in ("role", "region", "name", "http", "grpc", "pid"):
        table.add_column(col, no_wrap=True)
    gw_pid = str(stack.gateway_proc.pid) if stack.gateway_proc else "-"
    table.add_row(
        "gateway",
        text(stack.config.gateway["home_region"] + " (home)"),
        "gateway",
        text(f"http://{stack.gateway_http}"),
        text(stack.gateway_grpc),
        gw_pid,
    )
    servers = list(stack.fleet.servers)
    for scaler in getattr(stack, "autoscalers", []):
        servers += list(scaler.servers.values())
    for s in servers:
        table.add_row("triton", *map(text, (s.spec.region, s.spec.name, s.http_url, s.grpc_address, s.pid)))
    console.print(table)
    for scaler in getattr(stack, "autoscalers", []):
        p = scaler.policy
        console.print(
            f"autoscaling {scaler.region}: {p.min_servers}-{p.max_servers} servers on {p.signal} "
            f"(target {p.target:g}, cool-down {p.scale_down_window_s:g}s), published as "
            f"{scaler.dns_name} on {scaler.dns.address}"
        )
    if stack.gateway_ops:
        console.print(
            f"gateway ops listener (metrics, admin): http://{stack.gateway_ops}/metrics, "
            f"http://{stack.gateway_ops}/admin/upstreams"
        )


@app.command("loadtest")
def loadtest_command(
    target: str = typer.Option(
        ..., "--target", help="Gateway (or Triton) URL: http://host:port, or host:port for gRPC."
    ),
    protocol: str = typer.Option("http-binary", "--protocol", help="http | http-binary | grpc"),
    model: str = typer.Option(..., "--model", help="Hot model name."),
    users: int = typer.Option(4, "--users", min=1),
    spawn_rate: float = typer.Option(4.0, "--spawn-rate"),
    duration: str = typer.Option("20s", "--duration", help="Bounded run time: 30s, 2m..."),
    requests: int | None = typer.Option(
        None, "--requests", min=1, help="Stop once this many requests were answered (or at --duration)."
    ),
    shape: str = typer.Option("steady", "--shape", help="steady | ramp | spike | soak"),
    keys: int = typer.Option(1000, "--keys", help="Distinct inputs (the key space)."),
    zipf: float = typer.Option(1.1, "--zipf", help="Zipf exponent of key popularity (0 = uniform)."),
    cold_model: str = typer.Option("", "--cold-model", help="A second, rarely used model."),
    cold_fraction: float = typer.Option(0.0, "--cold-fraction"),
    regions: str = typer.Option(
        "", "--regions", help="Pin requests to these regions at random (comma-separated)."
    ),
    metrics_url: str | None = typer.Option(
        None,
        "--metrics-url",
        help="The gateway's /metrics on its ops listener (listen.ops_port), e.g. "
        "http://127.0.0.1:8082/metrics; without it, no cache or spill-over figures.",
    ),
    slo: Path | None = typer.Option(
        None, "--slo", help="YAML with p95_ms, p99_ms, error_rate; breach = exit 1."
    ),
    out: Path = typer.Option(Path("runs/loadtest"), "--out"),
    samples: Path | None = typer.Option(
        None,
        "--samples",
        help="Data directory to draw real requests from (its val/ split): tensors for a tensor model, "
        "encoded images or text for a <model>_raw ensemble; default: synthetic tensors.",
    ),
) -> None:
    """Run a bounded locust load with skewed traffic; write CSV, HTML and PNG; gate on an SLO file.

    A gateway that requires API keys: export SKEWSERVE_API_KEY=<key> first (sent as x-api-key; an
    environment variable keeps the key out of shell history and process listings).
    """
    from loadtests.mix import MixSettings
    from loadtests.report import load_slo
    from loadtests.runner import LoadTestSpec, model_inputs, parse_duration, run_loadtest

    try:
        slo_bounds = load_slo(slo) if slo else None
        seconds = parse_duration(duration)
        inputs = model_inputs(target, protocol, model)
        if protocol == "http" and any(d == "BYTES" for _, d, _ in inputs) and samples is not None:
            raise ValueError(
                f"{model} takes BYTES (raw images or text), which JSON cannot carry as bytes: "
                "use --protocol http-binary or grpc"
            )
        spec = LoadTestSpec(
            target=target,
            protocol=protocol,
            users=users,
            spawn_rate=spawn_rate,
            duration_s=seconds,
            max_requests=requests,
            shape=shape,
            out_dir=out,
            metrics_url=metrics_url,
            slo=slo_bounds,
            mix=MixSettings(
                model=model,
                inputs=inputs,
                samples=str(samples.resolve()) if samples is not None else "",
                keys=keys,
                zipf_s=zipf,
                cold_model=cold_model,
                cold_fraction=cold_fraction,
                regions=tuple(r for r in regions.split(",") if r),
            ),
        )
    except Exception as exc:  # bad options or an unreachable target: say which
        error(exc)
        raise typer.Exit(2) from exc
    with console.status(text(f"locust: {users} {protocol} users, {shape} shape, {seconds:.0f}s")):
        try:
            result = run_loadtest(spec)
        except RuntimeError as exc:
            error(exc)
            raise typer.Exit(1) from exc
    print_loadtest(result)
    if result.breaches:
        error("; ".join(result.breaches), label="SLO breached")
        raise typer.Exit(1)


def print_loadtest(result: Any) -> None:
    table = Table(title="load test")
    for col in ("request", "requests", "failures", "rps", "p50 ms", "p95 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "request" else "right", no_wrap=True)
    for r in [*result.rows, result.total]:
        table.add_row(
            text(r.name),
            str(r.requests),
            str(r.failures),
            f"{r.rps:.1f}",
            f"{r.p50_ms:.1f}",
            f"{r.p95_ms:.1f}",
            f"{r.p99_ms:.1f}",
        )
    console.print(table)
    extra = []
    if result.cache_hit_rate is not None:
        extra.append(f"gateway cache hit rate {100 * result.cache_hit_rate:.1f}%")
    if result.spillovers is not None:
        extra.append(f"spill-overs {result.spillovers:.0f}")
    if extra:
        say(", ".join(extra))
    say("files: " + ", ".join(str(p) for p in result.files.values()))


@app.command("plan")
def plan_command(
    traffic: Path = typer.Option(
        ..., "--traffic", help="YAML: per region peak_rps and a 24-value daily curve."
    ),
    prices: Path = typer.Option(
        ..., "--prices", help="YAML: per instance type on_demand, reserved, spot $/h."
    ),
    capacity: Path | None = typer.Option(
        None, "--capacity", help="YAML: measurements (instance_type, servers, rps, p99_ms)."
    ),
    loadtest_dir: Path | None = typer.Option(
        None, "--loadtest", help="Use a `skewserve loadtest --out` directory as the measurement."
    ),
    servers_tested: int = typer.Option(
        1, "--servers-tested", min=1, help="Triton servers behind --loadtest."
    ),
    instance_type: str = typer.Option("local", "--instance-type", help="Instance type --loadtest ran on."),
    slo_p99_ms: float = typer.Option(
        100.0, "--slo-p99-ms", min=0.001, help="Latency SLO capacity is read at."
    ),
    cache_hit_rate: float = typer.Option(0.0, "--cache-hit-rate", min=0.0, max=0.99),
    spot_share: float = typer.Option(0.0, "--spot-share", min=0.0, max=1.0, help="Elastic servers on spot."),
    utilization: float = typer.Option(
        0.7, "--utilization", min=0.01, max=1.0, help="Planned load / capacity."
    ),
    min_servers: int = typer.Option(2, "--min-servers", min=1, help="Per region, at every hour."),
    out: Path = typer.Option(Path("runs/plan"), "--out", help="Writes plan.json and plan.png here."),
) -> None:
    """Servers per region over the day, cost per hour and month, cost per million inferences."""
    import json

    from skewserve.plan import (
        PlanInputError,
        PlanOptions,
        capacity_from_loadtest,
        load_capacity,
        load_prices,
        load_traffic,
        loadtest_warnings,
        make_plan,
        plot_plan,
    )

    _setup_logging(False)
    if (capacity is None) == (loadtest_dir is None):
        raise typer.BadParameter(
            "give exactly one of --capacity FILE or --loadtest DIR", param_hint="--capacity"
        )
    try:
        caps = (
            load_capacity(capacity, slo_p99_ms)
            if capacity is not None
            else capacity_from_loadtest(loadtest_dir, servers_tested, instance_type, slo_p99_ms)  # type: ignore[arg-type]
        )
        opts = PlanOptions(
            cache_hit_rate=cache_hit_rate,
            spot_share=spot_share,
            utilization=utilization,
            min_servers=min_servers,
        )
        plan = make_plan(load_traffic(traffic), caps, load_prices(prices), opts)
    except PlanInputError as exc:
        error(exc)
        raise typer.Exit(2) from exc
    for note in loadtest_warnings(loadtest_dir) if loadtest_dir is not None else []:
        notice(note, "warning")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan.summary(), indent=2))
    plot_plan(plan, out / "plan.png")
    table = Table(title="skewserve plan (per region)")
    for col in ("region", "type", "rps/server", "servers min-max", "reserved", "autoscaler", "$/month"):
        table.add_column(col, no_wrap=True)
    for r in plan.regions:
        table.add_row(
            *map(
                text,
                (
                    r.region,
                    r.instance_type,
                    f"{r.capacity_rps:g}",
                    f"{min(r.servers)}-{max(r.servers)}",
                    r.baseline,
                    f"{r.autoscaler_min}-{r.autoscaler_max}",
                    f"{r.monthly_cost:,.2f}",
                ),
            )
        )
    console.print(table)
    s = plan.summary()
    say(f"cost: ${s['cost_per_hour']:,.2f}/hour, ${s['monthly_cost']:,.2f}/month")
    say(f"cost per million inferences: ${s['cost_per_million_inferences']:.4f}")
    say(
        f"cache saves ${s['cache_saves_per_month']:,.2f}/month, spot saves ${s['spot_saves_per_month']:,.2f}/month"
    )
    say(f"all on demand without cache: ${s['all_on_demand_monthly_cost']:,.2f}/month")
    say(f"written: {out / 'plan.json'}, {out / 'plan.png'}")


@app.command("demo")
def demo_command(
    out: Path = typer.Option(
        Path("runs/demo"), "--out", help="Working directory for data, artifact, logs, reports."
    ),
    repo: Path = typer.Option(Path("model_repository"), "--repo", help="Model repository to publish into."),
    load_seconds: float = typer.Option(20.0, "--load-seconds", help="Length of the locust run."),
    epochs: int = typer.Option(20, "--epochs"),
) -> None:
    """End to end: data -> 2-rank training -> export -> 2 regions of Triton + gateway -> calls -> load -> summary."""
    import json as _json

    from skewserve.demo import Demo, DemoFailed

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = Demo(out, repo, console, load_seconds=load_seconds, epochs=epochs).run()
    except DemoFailed as exc:
        error(exc, label="demo stopped")
        raise typer.Exit(1) from exc
    (out / "summary.json").write_text(_json.dumps(summary, indent=2))
    if summary["failures"]:
        error(f"{summary['failures']} requests failed during the load")
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
