"""`skewserve cascade`: cascades of models (the gateway's `cascades:`); `cascade calibrate` writes a
stage's deferral rule (`skewserve.cascade_calibrate`).

torch and the training code are imported inside the command so that `skewserve --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from skewserve.commands.options import HELP_MARKUP
from skewserve.output import console, error, say, text

app = typer.Typer(
    help="Cascades: a small model answers first, a larger one what it is unsure of.\n\nDocs: docs/cascade.md",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)


@app.command("calibrate")
def calibrate_command(
    edge: Path = typer.Option(..., "--edge", help="The first stage's artifact (skewserve train --out)."),
    cloud: Path = typer.Option(..., "--cloud", help="The next stage's artifact."),
    data: Path = typer.Option(..., "--data", help="Data directory; its validation split is used."),
    target: str = typer.Option(
        "within=0.01",
        "--target",
        help="within=X: balanced accuracy at least the cloud model's minus X, fewest escalated; "
        "escalation=B: at most a share B escalated, best balanced accuracy.",
    ),
    rule: str = typer.Option("per-class", "--rule", help="per-class thresholds, or one global threshold."),
    out: Path = typer.Option(
        Path("runs/cascade/rule.json"), "--out", help="The rule file the gateway reads."
    ),
) -> None:
    """Fit the edge model's temperature and choose its deferral thresholds for a target.

    Docs: docs/cascade.md"""
    from skewserve.cascade_calibrate import CalibrationError, Target, calibrate  # lazy: torch

    try:
        doc = calibrate(edge, cloud, data, Target.parse(target), rule.replace("-", "_"), out)
    except (CalibrationError, FileNotFoundError, ValueError) as exc:
        error(exc)
        raise typer.Exit(2) from exc
    val = doc["validation"]
    say(
        f"rule {doc['kind']} version {doc['version']} ({doc['digest'][:16]}), temperature "
        f"{doc['temperature']:.3f} (NLL {val['temperature']['nll_before']:.3f} -> "
        f"{val['temperature']['nll_after']:.3f}) on {val['items']} validation items"
    )
    table = Table("", "balanced accuracy", "worst-class recall", "escalated")
    for name in ("edge", "cloud"):
        table.add_row(
            name, f"{val[name]['balanced_accuracy']:.4f}", f"{val[name]['worst_class_recall']:.4f}", ""
        )
    for name, key in (
        ("cascade", "cascade"),
        *((k.removeprefix("baseline_") + " (baseline)", k) for k in val if k.startswith("baseline_")),
    ):
        f = val[key]
        table.add_row(
            text(name),
            f"{f['balanced_accuracy']:.4f}",
            f"{f['worst_class_recall']:.4f}",
            f"{f['escalation_rate']:.1%}",
        )
    console.print(table)
    say(f"wrote {out}: name it as `rule:` of the first stage in the gateway's `cascades:`")
