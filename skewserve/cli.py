"""The `skewserve` command: data -> train -> export -> serve (Triton + gateway) -> load test.

Heavy imports (torch, onnx, grpc) happen inside each command so `skewserve --help` stays instant.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help=(
        "skewserve: train on skewed data, compile for NVIDIA Triton, serve across regions under skewed load.\n\n"
        "Flow: `data synth` -> `train` -> `export` -> `triton up` / `gateway` / `up` -> `loadtest`; "
        "`demo` runs it all end to end."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
triton_app = typer.Typer(help="Run real tritonserver processes locally (CPU profile).", no_args_is_help=True)
app.add_typer(triton_app, name="triton")
# Wide enough when piped (tests, logs) that endpoint URLs are never cut.
console = Console(width=None if Console().is_terminal else 200)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def wait_for_interrupt() -> None:
    """Block the foreground until Ctrl-C or SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass


@triton_app.command("up")
def triton_up(
    repo: Path = typer.Option(Path("model_repository"), "--repo", help="Triton model repository."),
    regions: str = typer.Option("local", "--regions", help="Comma-separated region names, e.g. us-east,eu-west."),
    per_region: int = typer.Option(1, "--per-region", min=1, help="Servers per region."),
    config_name: str = typer.Option("local", "--model-config-name", help="Config profile: configs/<name>.pbtxt ('' for config.pbtxt)."),
    control_mode: str = typer.Option("none", "--model-control-mode", help="none | poll | explicit."),
    log_dir: Path = typer.Option(Path("runs/triton-logs"), "--log-dir"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Start tritonserver processes per region on REPO, print their endpoints, stop them on Ctrl-C."""
    from skewserve.errors import SkewserveError
    from skewserve.triton_process import TritonFleet

    _setup_logging(verbose)
    region_list = [r.strip() for r in regions.split(",") if r.strip()]
    if not region_list:
        raise typer.BadParameter("give at least one region name, e.g. --regions us-east,eu-west", param_hint="--regions")
    try:
        fleet = TritonFleet.for_regions(
            repo, region_list, per_region, log_dir,
            model_config_name=config_name or None, model_control_mode=control_mode,
        )
        with console.status(f"starting {len(fleet.servers)} tritonserver process(es)"):
            fleet.start()
    except (SkewserveError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    table = Table(title="tritonserver endpoints")
    for col in ("region", "server", "http", "grpc", "metrics", "pid"):
        table.add_column(col, no_wrap=True)
    for s in fleet.servers:
        table.add_row(s.spec.region, s.spec.name, s.http_url, s.grpc_address, s.metrics_url, str(s.pid))
    console.print(table)
    console.print(f"logs: {log_dir}")
    console.print("serving; press Ctrl-C to stop")
    try:
        wait_for_interrupt()
    finally:
        fleet.stop()
        console.print("stopped all servers")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
