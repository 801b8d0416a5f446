"""A rollout is a change of desired state: the version enters canary, and reconcile passes (run
here, or by any running controller) check it server by server and promote it, or mark it failed
and put every server back on the served versions. A rollback is the same: a change of state
(the newest retired version, or a given one, served again) that the passes then apply.

Before the canary starts, versions carrying TensorRT plans are checked against every server (its
TensorRT, its GPU's compute capability, its version-compatible flag): a mismatch refuses the
rollout with nothing loaded anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from controller.canary import plan_refusal
from controller.config import ControllerConfig
from controller.errors import ControlError, RolloutError
from controller.fleet import ControlledServer
from controller.reconcile import Controller
from repository.desired_state import DesiredState, TrafficGate
from repository.errors import RepositoryError
from repository.state_store import StateStore


def _store_errors() -> tuple[type[BaseException], ...]:
    """What a store or a server can raise: each becomes a RolloutError with its message."""
    errors: list[type[BaseException]] = [ControlError, RepositoryError, OSError, ValueError]
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += [BotoCoreError, ClientError]
    except ImportError:
        pass
    return tuple(errors)


STORE_ERRORS = _store_errors()


@dataclass
class RolloutResult:
    state: DesiredState
    steps: list[str] = field(default_factory=list)
    observing: bool = False  # checked on every server; the traffic gate has not decided yet


def _wait_for_gate(store: StateStore, model: str, wait_s: float) -> DesiredState:
    """The model's state once its canary ended, or as it is after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        state = store.current(model)
        if state is None:
            raise RolloutError(f"{model} was removed from {store.url} during its rollout")
        if state.canary is None or time.monotonic() >= deadline:
            return state
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))


def static_servers(urls: list[str]) -> Callable[[], list[ControlledServer]]:
    servers = [ControlledServer(u, "", u) for u in urls]
    return lambda: servers


def _check_plans(controller: Controller, model: str, version: int) -> None:
    card = controller.store.card(model, version)
    for server in controller.servers():
        admin = controller.admin(server)
        try:
            reason = plan_refusal(admin, model, card, controller.cfg)
        finally:
            admin.close()
        if reason is not None:
            raise RolloutError(
                f"{server.name}: refusing to roll out {model} version {version}, the server cannot load "
                f"its TensorRT plans: {reason}; nothing was loaded"
            )


def rollout(
    store: StateStore,
    model: str,
    version: int,
    servers: Callable[[], list[ControlledServer]],
    key: str = "",
    cfg: ControllerConfig | None = None,
    share: float = 0.0,
    shadow: float = 0.0,
    gate: TrafficGate | None = None,
    wait_s: float = 0.0,
    regions: list[str] | None = None,
) -> RolloutResult:
    """Canary `version` on every server, then promote it; RolloutError (servers back on the served
    versions) when a server refuses it.

    With a traffic `share` or `shadow`, the version is promoted by the running controller once its
    traffic gate passes on the gateways' reports: this returns when every server passed its check
    (`observing` set), or, with `wait_s`, when the gate decided (or the wait ran out).

    With `regions`, each of those regions' controllers must find all its servers passed before the
    version is promoted (the regions are kept in the canary record, so every controller holds it);
    this returns (`observing`) once the servers it found passed and other regions are pending."""
    controller = Controller(store, servers, key, cfg, models=lambda: [model])
    if not servers():
        raise RolloutError(
            f"no server found to roll {model} version {version} onto: check --servers, or the region's "
            "discovery (DNS name, EndpointSlices)"
        )
    try:
        state = store.current(model)
        if state is None:
            raise RolloutError(f"{model} is not published in {store.url}; export it first")
        store.card(model, version)  # published and complete
        if state.canary is None or state.canary.version != version:
            _check_plans(controller, model, version)
        store.update(
            model,
            partial(
                DesiredState.start_canary,
                version=version,
                share=share,
                shadow=shadow,
                gate=gate,
                regions=regions,
            ),
        )
        final = controller.settle(model)
        if final.canary is not None:
            final = _wait_for_gate(store, model, wait_s)
            if final.canary is not None:
                return RolloutResult(final, controller.canary_log, observing=True)
    except RolloutError:
        raise
    except STORE_ERRORS as exc:
        raise RolloutError(str(exc)) from exc
    record = final.versions.get(version)
    if record is None or record.state != "promoted":
        reason = record.reason if record is not None else "the version was removed"
        raise RolloutError(f"{reason}; {model} stays on version(s) {', '.join(map(str, final.served))}")
    return RolloutResult(final, controller.canary_log)


def rollback(
    store: StateStore,
    model: str,
    to: int | None,
    servers: Callable[[], list[ControlledServer]],
    key: str = "",
    cfg: ControllerConfig | None = None,
) -> DesiredState:
    """Serve `to` (default: the newest retired version) again, and apply it to the servers found."""
    try:
        if store.current(model) is None:
            raise RolloutError(f"{model} is not published in {store.url}")
        state = store.update(model, partial(DesiredState.rollback, to=to))
        if servers():
            Controller(store, servers, key, cfg, models=lambda: [model]).reconcile_once()
    except RolloutError:
        raise
    except STORE_ERRORS as exc:
        raise RolloutError(str(exc)) from exc
    return state
