"""The `skewserve` app: every command group's module, assembled in the order `--help` lists them.

Flow: data -> train -> export -> serve (Triton + gateway) -> load test. Each command imports its heavy
libraries (torch, onnx, grpc, locust) when it runs, so `skewserve --help` stays instant.
"""

from __future__ import annotations

import typer

from skewserve.commands import (
    cascade,
    controller,
    data,
    demo,
    export,
    gateway,
    loadtest,
    plan,
    rollout,
    train,
    triton,
    up,
)
from skewserve.commands.options import HELP_MARKUP

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
app.command("train")(train.train_command)
app.command("export")(export.export_command)
app.command("rollout")(rollout.rollout_command)
app.command("rollback")(rollout.rollback_command)
app.command("state")(rollout.state_command)
app.command("canary")(rollout.canary_command)
app.command("controller")(controller.controller_command)
app.command("up")(up.up_command)
app.command("loadtest")(loadtest.loadtest_command)
app.command("plan")(plan.plan_command)
app.command("demo")(demo.demo_command)
app.add_typer(triton.app, name="triton")
app.add_typer(gateway.app, name="gateway")
app.add_typer(data.app, name="data")
app.add_typer(cascade.app, name="cascade")


def main() -> None:
    """Run the `skewserve` command line."""
    app()
