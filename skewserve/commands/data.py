"""`skewserve data`: generate long-tailed data sets, inspect a data set's class balance.

The data libraries (numpy, pandas, the generators) are imported inside each command so that
`skewserve --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from skewserve.commands.options import HELP_MARKUP
from skewserve.output import console, error, notice, say, text

app = typer.Typer(
    help=(
        "Data sets: generate long-tailed data, inspect class balance."
        "\n\nDocs: docs/models-and-data.md#bring-your-own-data"
    ),
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)


@app.command("synth")
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
    # lazy: numpy, pandas and pydantic, kept out of --help
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


@app.command("digits")
def data_digits(
    out: Path = typer.Option(
        Path("runs/digits"), "--out", help="Directory for train/val/test image folders."
    ),
    imbalance_ratio: float = typer.Option(50.0, "--imbalance-ratio", help="max/min training class count."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """scikit-learn's digits (8x8, shipped with it) as long-tailed PNG class folders, CIFAR-LT style."""
    from training.datasets_builtin import write_digits_lt  # lazy: numpy and PIL, kept out of --help

    counts = write_digits_lt(out, imbalance_ratio, seed=seed)
    say(f"wrote {out}/train, val, test (PNG, one folder per class)")
    say(f"training class sizes: {sorted(counts['train'], reverse=True)}; val and test balanced")


@app.command("topics")
def data_topics(
    out: Path = typer.Option(
        Path("runs/topics"), "--out", help="Directory for train/val/test tensor shards."
    ),
    imbalance_ratio: float = typer.Option(20.0, "--imbalance-ratio", help="max/min training class count."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Generated long-tailed topic classification text as token-id shards with vocab.txt."""
    from training.datasets_builtin import write_topics_lt  # lazy: numpy and PIL, kept out of --help

    sizes = write_topics_lt(out, ratio=imbalance_ratio, seed=seed)
    say(f"wrote {out}/train, val, test (tokens.npy, tokens.lengths.npy, labels.npy), vocab.txt, classes.txt")
    say(f"training class sizes: {sizes['train']}; val and test balanced")


@app.command("inspect")
def data_inspect(
    data: Path = typer.Option(..., "--data", help="Directory with train/val[/test] .parquet or .csv."),
    label: str = typer.Option("label", "--label"),
    val_fraction: float | None = typer.Option(
        None, "--val-fraction", help="Tables without a val file: split this share of each class off train."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the --val-fraction split (as `train --seed`)."),
) -> None:
    """Validate a data set as training would, and show each split's class counts and imbalance."""
    # lazy: numpy, pandas and the image readers, kept out of --help
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
