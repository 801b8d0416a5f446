"""`skewserve controller`: run the reconcile loop (`controller.runner.ControllerThread`) until stopped.

The controller modules are imported inside the command so that `skewserve --help` stays instant.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NoReturn

import typer

from skewserve.commands.foreground import setup_logging, wait_for_interrupt
from skewserve.commands.options import comma_list
from skewserve.output import error, say


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
    leader_lease_in: str = typer.Option(
        "store",
        "--leader-lease-in",
        help="Where the lease lives (with --leader-election): `store`, a record in the repository; "
        "`kubernetes`, a Lease object in the pod's namespace (its service account may get, create and "
        "update leases).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Reconcile every discovered Triton server onto each model's desired state, until stopped.
    The control key comes from SKEWSERVE_CONTROL_KEY (the servers' --http-restricted-api value).

    Docs: docs/control-plane.md#running-the-controller-as-an-operator-would"""
    # lazy: the controller modules and yaml, kept out of --help
    import yaml

    from controller.config import ControllerConfig
    from controller.fleet import fleet_config
    from controller.placement import PlacementConfig
    from controller.runner import ControllerThread
    from gateway.config import ConfigError

    setup_logging(verbose)
    logging.getLogger("controller").setLevel(logging.INFO)
    try:
        gw = fleet_config(config)
        placement_cfg = None
        if placement is not None:
            placement_cfg = PlacementConfig.model_validate(yaml.safe_load(placement.read_text()))
        cfg = ControllerConfig(
            interval_s=interval,
            load_timeout_s=load_timeout,
            keep_versions=keep_versions,
            servers_version_compatible=version_compatible,
            placement=placement_cfg,
            canary_regions=tuple(comma_list(canary_regions)),
            leader_lease_s=leader_lease,
        )
    except (ConfigError, ValueError, OSError) as exc:
        fail(exc)
    key = control_key()
    wanted = set(comma_list(regions)) if regions else None
    unknown = (wanted or set()) - {r.name for r in gw.regions}
    if unknown:
        fail(ValueError(f"regions {sorted(unknown)} are not in {config}"))
    tokens = listen_tokens(listen, tokens_dir) if listen else None
    store = checked_store(repo)
    if leader_lease_in not in ("store", "kubernetes"):
        fail(ValueError(f"--leader-lease-in must be store or kubernetes, got {leader_lease_in!r}"))
    records = kube_lease_records() if leader_election and leader_lease_in == "kubernetes" else None
    thread = ControllerThread(
        gw, store, key, cfg, regions=wanted, leader_election=leader_election, lease_records=records
    ).start()
    if listen:
        serve_api(thread, listen, tokens, with_demand=placement_cfg is not None)
    say(f"controller reconciling {repo} onto the servers of {config}; Ctrl-C stops it")
    try:
        wait_for_interrupt()
    finally:
        thread.stop()


def kube_lease_records() -> Any:
    """The leader's lease as a Kubernetes Lease of the pod's namespace (exit 2 outside a cluster)."""
    # lazy: the controller modules, kept out of --help
    from controller.errors import ControlError
    from controller.kube_lease import KubeAccess, KubeLeaseRecords

    try:
        return KubeLeaseRecords(KubeAccess.in_cluster())
    except ControlError as exc:
        fail(exc)


def fail(exc: Exception) -> NoReturn:
    """Print `exc` as the controller's error and stop with exit status 2 (a setting to fix)."""
    error(exc, label="controller")
    raise typer.Exit(2) from exc


def control_key() -> str:
    """The servers' control key, from SKEWSERVE_CONTROL_KEY; says so when it is unset."""
    key = os.environ.get("SKEWSERVE_CONTROL_KEY", "")
    if not key:
        say(
            "SKEWSERVE_CONTROL_KEY is not set: loads go out without a key (servers must not restrict the API)"
        )
    return key


def checked_store(repo: str) -> Any:
    """The repository's state store, refused (exit 2) unless its conditional writes are safe."""
    # lazy: the controller modules, kept out of --help
    from controller.store_probe import check_conditional_writes
    from repository.stores import open_store

    store = open_store(repo)
    try:
        check_conditional_writes(store)
    except Exception as exc:  # unsafe, unreachable or unwritable: the controller must not act on it
        fail(ValueError(f"model repository {repo}: {exc}"))
    return store


def listen_address(listen: str) -> tuple[str, str]:
    """HOST and PORT of --listen [HOST:]PORT; HOST defaults to 127.0.0.1."""
    host, _, port = listen.rpartition(":")
    return host or "127.0.0.1", port


def listen_tokens(listen: str, tokens_dir: Path | None) -> Any:
    """`controller_tokens` for --listen's host; exit 2 when the API would be open without them."""
    try:
        return controller_tokens(listen_address(listen)[0], tokens_dir)
    except ValueError as exc:
        fail(exc)


def serve_api(thread: Any, listen: str, tokens: Any, with_demand: bool) -> None:
    """Serve the controller's API on --listen; stop the loop and exit 2 when it cannot."""
    host, port = listen_address(listen)
    try:
        bound = thread.serve_demand(host, int(port), tokens)
    except (ValueError, OSError) as exc:
        thread.stop()
        fail(ValueError(f"--listen {listen}: {exc} (give [HOST:]PORT, a free port)"))
    say(
        f"controller API on http://{host}:{bound}: /v1/traffic (gateways' traffic.controller_url)"
        + (", /v1/demand (cold_start.controller_url)" if with_demand else "")
    )


def controller_tokens(host: str, tokens_dir: Path | None) -> Any:
    """The callers' tokens for the controller's API; ValueError when the API would be open beyond
    this machine without them."""
    from controller.api_auth import CallerTokens, is_loopback  # lazy: kept out of --help

    if tokens_dir is not None:
        return CallerTokens(tokens_dir)
    if not is_loopback(host):
        raise ValueError(
            f"--listen {host}: the controller's API would take traffic reports and load asks from "
            "anyone who reaches it; give --tokens-dir (one bearer token per caller) or listen on 127.0.0.1"
        )
    say("controller API without tokens: loopback only, every local process may call it")
    return None
