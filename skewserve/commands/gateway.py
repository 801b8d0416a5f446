"""`skewserve gateway`: run the gateway (`gateway.server.run`); `gateway hash-key`: hash an API key.

The gateway's modules are imported inside the commands so that `skewserve --help` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from skewserve.commands.options import HELP_MARKUP
from skewserve.output import error, notice

app = typer.Typer(
    help=("The multi-region KServe v2 gateway (HTTP + gRPC).\n\nDocs: docs/gateway.md"),
    invoke_without_command=True,
    rich_markup_mode=HELP_MARKUP,
)

KEY_IN_HISTORY_WARNING = (
    "a key given on the command line is saved in your shell history; "
    "omit it to type it at a hidden prompt or pipe it in: skewserve gateway hash-key < key.txt"
)


@app.callback()
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
    # lazy: the gateway's servers (grpc, starlette), kept out of --help
    from gateway.config import ConfigError, load_gateway_config
    from gateway.fleet.cascade import check_rules
    from gateway.fronts.listen import ListenError
    from gateway.operations.logs import configure_logging
    from gateway.server import run

    try:
        cfg = load_gateway_config(config)
        check_rules(cfg)
    except ConfigError as exc:
        error(exc)
        raise typer.Exit(2) from exc
    configure_logging(cfg.log_json, cfg.log_level.upper())
    try:
        run(cfg, config_path=config)
    except ListenError as exc:
        error(exc)
        raise typer.Exit(1) from exc


@app.command("hash-key")
def hash_key_command(
    key: str | None = typer.Argument(
        None,
        help="The API key to hash for auth.keys[].sha256. Omit it to read the key from standard input "
        "(a hidden prompt on a terminal), which keeps it out of shell history.",
        show_default=False,
    ),
) -> None:
    """Print the SHA-256 to put in the config for an API key (the key itself is never stored)."""
    from gateway.state.auth import hash_key  # lazy: kept out of --help

    if key is not None:
        notice(KEY_IN_HISTORY_WARNING, label="warning", to_stderr=True)
    else:
        key = read_key_from_stdin()
    if not key:
        error("the API key is empty; pipe in a key or type one at the prompt")
        raise typer.Exit(2)
    # Only the digest goes to stdout, so `$(skewserve gateway hash-key < key.txt)` captures it alone.
    typer.echo(hash_key(key))


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
