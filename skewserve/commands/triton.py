"""`skewserve triton up`: real tritonserver processes per region (`skewserve.triton_process.TritonFleet`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from skewserve.commands.foreground import setup_logging, wait_for_interrupt
from skewserve.commands.options import HELP_MARKUP, comma_list
from skewserve.output import console, error, say, text

if TYPE_CHECKING:
    from skewserve.triton_process import TritonFleet

app = typer.Typer(
    help=(
        "Run real tritonserver processes locally (CPU profile).\n\nDocs: docs/gateway.md#triton-servers-alone"
    ),
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)


@app.command("up")
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
    # lazy: pydantic and the Triton runtime, kept out of --help
    from skewserve.errors import SkewserveError
    from skewserve.triton_process import TritonFleet, response_cache_config

    setup_logging(verbose)
    region_list = comma_list(regions)
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
    print_fleet(fleet)
    say(f"logs: {log_dir}")
    say("serving; press Ctrl-C to stop")
    try:
        wait_for_interrupt()
    finally:
        fleet.stop()
        say("stopped all servers")


def print_fleet(fleet: TritonFleet) -> None:
    """A table of the fleet's servers and their endpoints."""
    table = Table(title="tritonserver endpoints")
    for col in ("region", "server", "http", "grpc", "metrics", "pid"):
        table.add_column(col, no_wrap=True)
    for s in fleet.servers:
        table.add_row(
            *map(text, (s.spec.region, s.spec.name, s.http_url, s.grpc_address, s.metrics_url, s.pid))
        )
    console.print(table)
