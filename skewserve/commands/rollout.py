"""`skewserve rollout`, `rollback`, `state`, `canary`: change or read a model's desired state.

Thin layers over `controller.rollout`; the controller modules (and the object-store client they may
open) are imported inside the commands so that `skewserve --help` stays instant.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from skewserve.commands.foreground import setup_logging
from skewserve.commands.options import comma_list
from skewserve.output import error, say

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
StateRepoOpt = typer.Option("model_repository", "--repo", help="Folder or s3://...")


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
    several regions, once every region's controller found all its servers passed.

    Docs: docs/control-plane.md#rollout-and-rollback-are-state-changes"""
    # lazy: the controller modules, kept out of --help
    from controller.config import ControllerConfig
    from controller.errors import RolloutError
    from controller.rollout import rollout
    from repository.desired_state import TrafficGate

    setup_logging(False)
    cfg = ControllerConfig(
        load_timeout_s=load_timeout,
        interval_s=1.0,
        server_tensorrt=server_tensorrt,
        gpu_capabilities=tuple(comma_list(gpu_capability)),
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
            canary_at = rollout_regions(canary_regions, config, log_dir)
            result = rollout(
                store, name, version, found, key, cfg, share, shadow, gate, wait, regions=canary_at
            )
        except (RolloutError, ValueError) as exc:
            error(exc, label="rollout failed")
            raise typer.Exit(1) from exc
    print_rollout(result, name, version, share, shadow)


def print_rollout(result: Any, name: str, version: int, share: float, shadow: float) -> None:
    """The rollout's steps, then whether the version is promoted or what it waits for."""
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
    elif result.observing:
        say(
            f"{name} version {version} passed its check on every server; it answers {share:.0%} of clients "
            f"and {shadow:.0%} of requests are mirrored to it; the running controller promotes it once "
            f"the traffic gate passes (see `skewserve canary {name}`)"
        )
    else:
        say(f"{name} version {version} promoted; served: {', '.join(map(str, result.state.served))}")


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
    and by every controller from then on (it survives restarts).

    Docs: docs/control-plane.md#rollout-and-rollback-are-state-changes"""
    # lazy: the controller modules, kept out of --help
    from controller.errors import RolloutError
    from controller.rollout import rollback

    setup_logging(False)
    with control_targets(servers, regions, config, log_dir, repo, "rollback failed") as (store, found, key):
        try:
            state = rollback(store, name, to, found, key)
        except RolloutError as exc:
            error(exc, label="rollback failed")
            raise typer.Exit(1) from exc
    say(
        f"{name} serves version(s) {', '.join(map(str, state.served))} (desired state generation {state.generation})"
    )


def state_command(
    name: str | None = typer.Argument(None, help="Model name (default: every model)."),
    repo: str = StateRepoOpt,
) -> None:
    """Print models' desired state: served versions, canary, each version's state, load failures.

    Docs: docs/control-plane.md#one-record-per-model"""
    # lazy: the controller modules, kept out of --help
    from controller.rollout import STORE_ERRORS
    from repository.stores import open_store

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


def canary_command(
    name: str = typer.Argument(..., help="Model name."),
    repo: str = StateRepoOpt,
) -> None:
    """Print a model's canary: version, traffic share, shadow share, servers passed, and the traffic
    gate's latest reading (per-class agreement of shadow answers, errors, p99).

    Docs: docs/control-plane.md#the-traffic-gate"""
    # lazy: the controller modules, kept out of --help
    from controller.rollout import STORE_ERRORS
    from repository.stores import open_store

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
    # lazy: the controller modules, kept out of --help
    from controller.fleet import ControlledServer
    from controller.rollout import static_servers
    from controller.runner import ControllerThread
    from repository.stores import open_store

    urls = comma_list(servers)
    if regions and config is None:
        raise typer.BadParameter(
            "--regions needs --config (the stack or gateway config naming the servers)",
            param_hint="--regions",
        )
    key = os.environ.get("SKEWSERVE_CONTROL_KEY", "")
    thread = None
    found: Any = static_servers(urls)
    if config is not None:
        gw, stack_repo, stack_key = _config_targets(config, log_dir, label)
        names = {r.name for r in gw.regions}
        wanted = set(comma_list(regions)) if regions else names
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


def _config_targets(config: Path, log_dir: Path, label: str) -> tuple[Any, str | None, str]:
    """`rollout_targets`, its error printed under `label` and turned into exit status 2."""
    try:
        return rollout_targets(config, log_dir)
    except ValueError as exc:
        error(exc, label=label)
        raise typer.Exit(2) from exc


def rollout_regions(canary_regions: str | None, config: Path | None, log_dir: Path) -> list[str] | None:
    """The regions a canary must pass: the option's, else every region of --config (a region whose
    controller is down then holds the canary), else none named (the servers given)."""
    if canary_regions is not None:
        return comma_list(canary_regions)
    if config is None:
        return None
    gw, _, _ = rollout_targets(config, log_dir)
    return sorted(r.name for r in gw.regions)


def rollout_targets(config: Path, log_dir: Path) -> tuple[Any, str | None, str]:
    """The gateway config naming the servers (a running stack's generated one, or `config` itself),
    the stack's repository and control key; ValueError in one line saying what is wrong."""
    # lazy: the controller and gateway config modules, kept out of --help
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
