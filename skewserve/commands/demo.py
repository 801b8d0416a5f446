"""`skewserve demo`: the whole flow end to end (`skewserve.demo.Demo`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

from skewserve.output import console, error


def demo_command(
    out: Path = typer.Option(
        Path("runs/demo"), "--out", help="Working directory for data, artifact, logs, reports."
    ),
    repo: Path = typer.Option(Path("model_repository"), "--repo", help="Model repository to publish into."),
    load_seconds: float = typer.Option(20.0, "--load-seconds", help="Length of the locust run."),
    epochs: int = typer.Option(20, "--epochs"),
) -> None:
    """End to end: data -> 2-rank training -> export -> 2 regions of Triton + gateway -> calls -> load -> summary.

    Docs: README.md#walkthrough-what-make-demo-does-as-commands"""
    from skewserve.demo import Demo, DemoFailed  # lazy: every stage's modules, kept out of --help

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = Demo(out, repo, console, load_seconds=load_seconds, epochs=epochs).run()
    except DemoFailed as exc:
        error(exc, label="demo stopped")
        raise typer.Exit(1) from exc
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary["failures"]:
        error(f"{summary['failures']} requests failed during the load")
        raise typer.Exit(1)
