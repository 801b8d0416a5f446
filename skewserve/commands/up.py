"""`skewserve up`: the local stack (`skewserve.stack.LocalStack`): Triton servers and the gateway.

The stack's modules (pydantic, the gateway's config) are imported inside the command so that
`skewserve --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from skewserve.commands.foreground import setup_logging, wait_for_interrupt
from skewserve.output import console, error, notice, say, text


class StackDied(RuntimeError):
    """A process of the local stack exited on its own."""


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
    """Start the Triton servers the config names (local CPU profile) and the gateway; Ctrl-C stops all.

    Docs: README.md#walkthrough-what-make-demo-does-as-commands"""
    # lazy: the stack's modules, kept out of --help
    from skewserve.errors import SkewserveError
    from skewserve.stack import LocalStack

    setup_logging(False)
    stack_cfg = stack_config(config, repo, response_cache_mb, autoscale)
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


def stack_config(config: Path, repo: Path | None, response_cache_mb: int | None, autoscale: bool) -> Any:
    """The stack config file with the command's overrides; exit 2 when it is not valid."""
    # lazy: the stack's modules, kept out of --help
    from skewserve.autoscale import AutoscalePolicy
    from skewserve.stack import StackConfigError, load_stack_config

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
        stack_cfg = stack_cfg.model_copy(update={"autoscale": AutoscalePolicy()})
    return stack_cfg


def watch_stack(stack: Any) -> None:
    """Raise StackDied when the gateway or a (non-autoscaled) Triton server of `up` has exited."""
    proc = stack.gateway_proc
    if proc is not None and proc.poll() is not None:
        raise StackDied(f"the gateway exited with code {proc.returncode}; see {stack.log_dir}/gateway.log")
    edge = getattr(stack, "edge", None)
    if edge is not None and edge.gateway is not None and edge.gateway.proc.poll() is not None:
        raise StackDied(f"the edge gateway exited; see {edge.log_dir}/gateway.log")
    for server in stack.fleet.servers:
        if server.pid is not None and not server.is_running():
            raise StackDied(f"tritonserver {server.spec.name} exited; see its log in {stack.log_dir}")
    if edge is None:
        return
    for server in edge.fleet.servers:
        if server.pid is not None and not server.is_running():
            raise StackDied(f"edge tritonserver {server.spec.name} exited; see its log in {edge.log_dir}")


def loaded_models(stack: Any) -> dict[str, list[str]]:
    """Models each Triton server of the stack has loaded (statistics API: the repository API
    answers only the controller)."""
    from controller.triton_admin import TritonAdmin  # lazy: kept out of --help

    out: dict[str, list[str]] = {}
    for server in stack.fleet.servers:
        admin = TritonAdmin(server.spec.name, server.http_address, "", 10.0)
        try:
            out[server.spec.name] = sorted(admin.loaded())
        finally:
            admin.close()
    return out


def print_stack(stack: Any) -> None:
    """A table of the gateway and every Triton server, then autoscaling and the ops listener."""
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
    edge = getattr(stack, "edge", None)
    if edge is not None and edge.gateway is not None:
        table.add_row(
            "edge gateway",
            "edge",
            "edge-gateway",
            text(f"http://{edge.gateway.http}"),
            text(edge.gateway.grpc),
            str(edge.gateway.proc.pid),
        )
        servers += list(edge.fleet.servers)
    for s in servers:
        table.add_row("triton", *map(text, (s.spec.region, s.spec.name, s.http_url, s.grpc_address, s.pid)))
    console.print(table)
    if edge is not None and edge.gateway is not None:
        names = [c["name"] for c in edge.cfg.gateway.get("cascades", [])]
        console.print(
            f"edge tier: cascades {', '.join(names) or '(none)'} at http://{edge.gateway.http}; "
            f"escalations go to the gateway above (ops: http://{edge.gateway.ops}/metrics)"
        )
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
