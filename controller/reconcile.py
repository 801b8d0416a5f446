"""The reconcile loop: every pass compares each model's desired state with what each discovered
server has loaded, and acts on the difference (level-triggered, so a crash or a restarted server
is repaired by the next pass).

Per pass, for every server and model: load when the READY versions differ from the wanted ones
(the served versions; plus the canary where it passed), unload models the repository no longer
holds. Never on doubt: a model whose record cannot be read keeps whatever servers have loaded, and
a listing that failed or came back empty unloads nothing; a model is unloaded as gone only once
`absent_passes_before_unload` passes in a row listed the repository, non-empty, without it.
A load that fails is recorded in the model's state (which version failed where) and retried
after a back-off; the server and its other models keep serving. Then each model in canary advances:
the servers not yet checked are checked one by one under the canary lease; all passed means
promoted, one failure means the version is failed and every server goes back to the served ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from controller.canary import CandidateConfigs, check
from controller.config import ControllerConfig
from controller.demand import DemandTracker, idle_seconds
from controller.errors import ControlError
from controller.fleet import ControlledServer
from controller.placement import ModelView
from controller.placement_policy import POLICIES
from controller.server_readiness import ServerReadiness, readiness_of
from controller.traffic_gate import TrafficReports, describe, verdict
from controller.triton_admin import TritonAdmin, loaded_versions
from repository.desired_state import DesiredState
from repository.state_store import StateStore

logger = logging.getLogger(__name__)
MAX_PARALLEL_SERVERS = 8
DEMAND_HOLD_S = 60.0  # how long a gateway's ask keeps a model placed without measured traffic
ASKED_RATE = 1e-3  # the rate an asked-for model counts with: enough for one copy


@dataclass
class PassReport:
    """What one pass saw and did (printed by the CLI, asserted by tests)."""

    servers: list[str] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    canary: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # loaded, not listed, not yet confirmed gone
    placement: dict[str, list[str]] = field(default_factory=dict)  # server -> models it holds
    evictions: list[str] = field(default_factory=list)
    unplaced: dict[str, str] = field(default_factory=dict)
    unfit: set[str] = field(default_factory=set)  # models larger than any server's capacity
    unloads: list[str] = field(default_factory=list)
    failed_loads: int = 0
    store_errors: dict[str, int] = field(default_factory=dict)  # operation -> failures this pass
    held: dict[str, list[str]] = field(default_factory=dict)  # server -> models READY at the start

    def store_error(self, op: str) -> None:
        self.store_errors[op] = self.store_errors.get(op, 0) + 1


class Controller:
    def __init__(
        self,
        store: StateStore,
        servers: Callable[[], list[ControlledServer]],
        key: str,
        cfg: ControllerConfig | None = None,
        models: Callable[[], list[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.clock = clock  # when a failed load is tried again (tests move it)
        self.servers = servers
        self.key = key
        self.cfg = cfg or ControllerConfig()
        self.models = models or store.models
        # scoped to some models (a rollout command): what else servers hold is not its business
        self.scoped = models is not None
        self._materialized: dict[str, int] = {}
        self.me = f"controller-{uuid.uuid4().hex[:8]}"
        self.canary_log: list[str] = []  # every canary step this controller took, for the CLI
        self._retry_at: dict[tuple[str, str, tuple[int, ...]], tuple[float, float]] = {}
        # model -> passes in a row whose good listing did not hold it while a server had it loaded
        self._absent: dict[str, int] = {}
        self._gone: set[str] = set()  # confirmed absent: unloaded wherever a server still holds it
        self.passes = 0
        self.failed_passes = 0  # passes that raised (a store write failing, say): retried next time
        self.last_pass_s = 0.0
        # placement by demand (cfg.placement): what it measured and decided last
        self.demand = DemandTracker()
        self.copies: dict[str, dict[str, int]] = {}  # region -> model -> copies
        self.load_s: dict[str, float] = {}  # model -> seconds its loads take (EWMA)
        self.placed: dict[str, set[str]] | None = None  # server -> models it holds
        self.held_anywhere: set[str] = set()  # models some server had loaded at the pass's start
        self.readiness: dict[str, ServerReadiness] = {}  # server -> what it lacked of what it should hold
        self._file_bytes: dict[tuple[str, tuple[int, ...]], int] = {}
        # (region, model) -> when a gateway last asked for it (epoch s); region "" for any region
        self.requested: dict[tuple[str, str], float] = {}
        self._wake: asyncio.Event | None = None
        # canaries with a traffic share or shadow: the gateways' reports and what they should do
        self.traffic = TrafficReports()
        self.traffic_plans: dict[str, dict[str, Any]] = {}

    def request_demand(self, model: str, region: str = "") -> None:
        """A gateway of `region` holds requests for `model`: give it a copy there (in every region
        when the region is not one of the controller's), and run a pass now (in the loop)."""
        self.requested[(region, model)] = time.time()
        if self._wake is not None:
            self._wake.set()

    def admin(self, server: ControlledServer) -> TritonAdmin:
        return TritonAdmin(server.name, server.http, self.key, self.cfg.load_timeout_s)

    # -- one pass --------------------------------------------------------------------------------
    def reconcile_once(self) -> PassReport:
        report = PassReport()
        states: dict[str, DesiredState] = {}
        try:
            listed: list[str] | None = list(self.models())
        except Exception as exc:  # the store is down or slow: no model's records this pass
            report.failures.append(f"repository listing failed: {exc}; nothing unloaded this pass")
            report.store_error("list")
            logger.warning("repository listing failed: %s; nothing unloaded this pass", exc)
            listed = None
        if listed is not None and not listed and not self.scoped:
            # An empty prefix is far likelier a wrong bucket, a permissions change or a partial
            # listing than an operator removing every model: doubt, so nothing is unloaded.
            report.failures.append("repository listing came back empty; nothing unloaded this pass")
            logger.warning("repository listing came back empty; nothing unloaded this pass")
            listed = None
        unreadable: set[str] = set()
        for model in listed or []:
            try:  # one model's unreadable state (or store error) stops no other model
                state = self.store.current(model)
                if state is not None and self._materialized.get(model) != state.generation:
                    # configs follow the state even after a racing writer pinned an older one
                    self.store.materialize(state)
                    self._materialized[model] = state.generation
            except Exception as exc:
                report.failures.append(f"{model}: desired state unreadable: {exc}")
                report.store_error("read")
                logger.warning("%s: desired state unreadable: %s", model, exc)
                unreadable.add(model)
                continue
            if state is not None:
                states[model] = state
        plans: dict[str, dict[str, Any]] | None = None
        if not self.scoped and listed is not None:
            # A model whose record could not be read keeps the plan the gateways follow now.
            plans = traffic_plans(states.values())
            plans.update({m: p for m, p in self.traffic_plans.items() if m in unreadable})
            # Until this pass has seen what the servers hold, a model whose canary just ended keeps
            # a pin: a gateway polling meanwhile would otherwise go unpinned while the candidate is
            # still loaded (a client got the failed shadow candidate that way in a CI run).
            self.traffic_plans = plans | ended_pins(states, self.traffic_plans, plans)
        servers = self.servers()
        report.servers = [s.name for s in servers]
        if servers:
            # Servers in parallel: one slow load (a big model, a cold S3 copy) holds up no other server.
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SERVERS, len(servers))) as pool:
                observed = dict(
                    zip(servers, pool.map(lambda s: self._observe(s, report), servers), strict=True)
                )
                reachable = {s: stats for s, stats in observed.items() if stats is not None}
                report.held = {s.name: sorted(loaded_versions(st)) for s, st in reachable.items()}
                self.held_anywhere = {m for stats in reachable.values() for m in loaded_versions(stats)}
                if plans is not None:
                    self.traffic_plans = plans | lingering_pins(states, reachable.values(), plans)
                self._gone = self._confirm_absent(listed, report)
                self.placed = self._place(reachable, states, report) if self.cfg.placement else None
                list(
                    pool.map(lambda item: self._converge(item[0], item[1], states, report), reachable.items())
                )
            # a server this pass could not reach (or no longer found) is not known to serve anything
            self.readiness = {s.name: self.readiness[s.name] for s in reachable if s.name in self.readiness}
        for state in states.values():
            if state.newer:
                report.failures.append(
                    f"{state.model}: desired state has format {state.format} (a newer controller's): "
                    "served as it says, its canary left to that controller; upgrade this one"
                )
                continue
            if state.canary is not None:
                try:
                    self._advance_canary(state, servers, report)
                except Exception as exc:  # e.g. the version's card cannot be read: reported, others go on
                    report.failures.append(f"{state.model}: canary of version {state.canary.version}: {exc}")
                    logger.warning("%s: canary failed to advance: %s", state.model, exc)
        self.passes += 1
        return report

    def _observe(self, server: ControlledServer, report: PassReport) -> list[dict[str, Any]] | None:
        admin = self.admin(server)
        try:
            return admin.stats()
        except ControlError as exc:
            report.unreachable.append(f"{server.name}: {exc}")
            return None
        finally:
            admin.close()

    def _place(
        self,
        observed: dict[ControlledServer, list[dict[str, Any]]],
        states: dict[str, DesiredState],
        report: PassReport,
    ) -> dict[str, set[str]]:
        """Which models each server holds this pass (placement by demand, per region)."""
        cfg = self.cfg.placement
        assert cfg is not None
        self.demand.observe({s.name: s.region for s in observed}, {s.name: st for s, st in observed.items()})
        now = time.time()
        placed: dict[str, set[str]] = {}
        for region in sorted({s.region for s in observed}):
            members = {s.name: st for s, st in observed.items() if s.region == region}
            views = {}
            for model, state in states.items():
                if not state.served:
                    continue
                holders = [n for n, st in members.items() if any(e["name"] == model for e in st)]
                rate = self.demand.rate(region, model)
                asked = self.requested.get((region, model))
                if asked is None and not any(r == region for r, _ in self.requested):
                    # an ask from a region this controller does not run counts everywhere
                    asked = max((t for (r, m), t in self.requested.items() if m == model), default=None)
                since_asked = now - asked if asked is not None else math.inf
                if since_asked < DEMAND_HOLD_S:
                    # asked for by a gateway: at least one copy, and in use as far as eviction goes
                    rate = max(rate, ASKED_RATE)
                views[model] = ModelView(
                    model,
                    self._footprint(model, state.served, cfg.footprint_overhead),
                    rate,
                    self.load_s.get(model, 1.0),
                    {n: min(idle_seconds(members[n], model, now), since_asked) for n in holders},
                    asked=since_asked < DEMAND_HOLD_S and not holders,
                )
            held = {n: {e["name"] for e in st} for n, st in members.items()}
            planner = POLICIES[cfg.policy]
            plan = planner(sorted(members), held, views, self.copies.get(region, {}), cfg)
            self.copies[region] = plan.copies
            placed.update(plan.holds)
            report.evictions += plan.evictions
            for line in plan.evictions:
                logger.info("placement in %s: %s", region, line)
            report.unplaced.update(plan.unplaced)
            report.unfit |= plan.unfit
        report.placement = {n: sorted(ms) for n, ms in placed.items()}
        return placed

    def _footprint(self, model: str, served: list[int], overhead: float) -> int:
        reported = self.demand.reported_bytes.get(model)
        if reported:
            return reported
        key = (model, tuple(served))
        if key not in self._file_bytes:
            self._file_bytes[key] = sum(self.store.version_bytes(model, v) for v in served)
        return int(self._file_bytes[key] * overhead)

    def _converge(
        self,
        server: ControlledServer,
        stats: list[dict[str, Any]],
        states: dict[str, DesiredState],
        report: PassReport,
    ) -> None:
        admin = self.admin(server)
        loaded = loaded_versions(stats)
        placed = None if self.placed is None else self.placed.get(server.name, set())
        wanted = {
            model: state.wanted_on(server.name)
            for model, state in states.items()
            if state.served and (placed is None or model in placed)
        }
        self.readiness[server.name] = readiness_of(server.name, server.http, wanted, loaded)
        try:
            now = self.clock()
            todo: list[tuple[str, DesiredState, list[int], list[int]]] = []
            # evictions first: they make the room the loads of this pass may need
            for model, state in sorted(states.items()):
                if placed is not None and model not in placed:
                    if model in loaded:
                        try:
                            admin.unload(model)
                            report.unloads.append(f"{server.name}: {model} evicted (placement)")
                            logger.info("%s: %s evicted (placement)", server.name, model)
                        except ControlError as exc:
                            report.failures.append(str(exc))
                    continue
                canary = state.canary
                if (
                    canary is not None
                    and canary.checking == server.name
                    and canary.held_by_other(self.me, self.cfg.lease_s, time.time())
                ):
                    continue  # another controller is checking the canary here right now
                want = state.wanted_on(server.name)
                have = loaded.get(model, [])
                if canary is not None and have == sorted({*want, canary.version}):
                    # The undecided canary beside the wanted versions: a check (by this controller or
                    # another, whose record this pass may not have read yet) put it there. Unloading
                    # it would reload the model under a check and its traffic; a failed canary is
                    # unloaded once its state says so.
                    continue
                if not want or have == want:
                    if have == want and state.load_failures:
                        self._record(
                            model, partial(DesiredState.load_succeeded, versions=want, server=server.name)
                        )
                    continue
                retry_at, _ = self._retry_at.get((server.name, model, tuple(want)), (0.0, 0.0))
                if now >= retry_at:
                    todo.append((model, state, want, have))
            # models no server holds first (requests wait for them), then by demand
            todo.sort(
                key=lambda t: (t[0] in self.held_anywhere, -self.demand.rate(server.region, t[0]), t[0])
            )
            if len(todo) > 1 and self.cfg.loads_per_server > 1:
                with ThreadPoolExecutor(max_workers=min(self.cfg.loads_per_server, len(todo))) as pool:
                    list(pool.map(lambda t: self._load(server, t[0], t[1], t[2], t[3], report), todo))
            else:
                for model, state, want, have in todo:
                    self._load(server, model, state, want, have, report, admin)
            for model in [] if self.scoped else sorted(set(loaded) & self._gone):
                try:
                    admin.unload(model)
                    report.unloads.append(f"{server.name}: {model} unloaded (not in the repository)")
                except ControlError as exc:
                    report.failures.append(str(exc))
        finally:
            admin.close()

    def _confirm_absent(self, listed: list[str] | None, report: PassReport) -> set[str]:
        """Loaded models this pass may unload as gone: absent from `absent_passes_before_unload`
        good listings in a row. A pass without a good listing neither counts nor confirms."""
        if listed is None or self.scoped:
            return set()
        absent = self.held_anywhere - set(listed)
        self._absent = {m: self._absent.get(m, 0) + 1 for m in absent}
        needed = self.cfg.absent_passes_before_unload
        for model, passes in sorted(self._absent.items()):
            if passes < needed:
                report.absent.append(f"{model}: not listed ({passes}/{needed} passes before unloading)")
        return {m for m, passes in self._absent.items() if passes >= needed}

    def _load(
        self,
        server: ControlledServer,
        model: str,
        state: DesiredState,
        want: list[int],
        have: list[int],
        report: PassReport,
        admin: TritonAdmin | None = None,
    ) -> None:
        """Load `want` of `model` on `server`; a failure is recorded in the state and retried later."""
        own = admin is None
        client = self.admin(server) if admin is None else admin
        key = (server.name, model, tuple(want))
        _, wait = self._retry_at.get(key, (0.0, self.cfg.retry_after_s))
        started, asked = time.monotonic(), self.clock()
        try:
            client.load(model, None if want == state.served else want)
            took = time.monotonic() - started
            self.load_s[model] = 0.5 * took + 0.5 * self.load_s.get(model, took)
        except ControlError as exc:
            reason = str(exc)
            self._retry_at[key] = (asked + wait, min(wait * 2, 600.0))
            for v in [v for v in want if v not in have] or want:
                self._record(
                    model, partial(DesiredState.load_failed, version=v, server=server.name, reason=reason)
                )
            report.failures.append(f"{server.name}: {model} {want}: {reason}")
            report.failed_loads += 1
            logger.warning("%s: loading %s versions %s failed: %s", server.name, model, want, reason)
            return
        finally:
            if own:
                client.close()
        self._retry_at.pop(key, None)
        report.loads.append(f"{server.name}: {model} {have} -> {want}")
        logger.info("%s: %s now serves versions %s (was %s)", server.name, model, want, have)

    def _record(self, model: str, change: Callable[[DesiredState], DesiredState]) -> None:
        """Note a load's outcome in the record, best effort: a record this controller may not write
        (a newer format) or a store error must not stop the server's other loads."""
        try:
            self.store.update(model, change)
        except Exception as exc:
            logger.warning("%s: load outcome not recorded: %s", model, exc)

    def _advance_canary(
        self, state: DesiredState, servers: list[ControlledServer], report: PassReport
    ) -> None:
        model = state.model
        canary = state.canary
        assert canary is not None
        # with placement, the canary is checked where the model is placed
        eligible = [s for s in servers if self.placed is None or model in self.placed.get(s.name, set())]
        pending = [s for s in eligible if s.name not in canary.passed]
        if not pending:
            if eligible:  # no server to check on: a canary never passes by default
                self._conclude_canary(state, eligible, report)
            return
        card = self.store.card(model, canary.version)
        configs = CandidateConfigs(
            self.store.version_configs(model, canary.version),
            self.store.version_configs(model, max(state.served)) if state.served else {},
        )
        if not configs.served:  # the served version predates configs kept per version
            configs = CandidateConfigs(configs.own, self.store.configs(model))
        for server in pending:
            if not self._check_canary_on(state, server, card, configs, report):
                return

    def _conclude_canary(
        self, state: DesiredState, eligible: list[ControlledServer], report: PassReport
    ) -> None:
        """Every eligible server passed: mark this region done, and promote once every region is."""
        model, canary = state.model, state.canary
        assert canary is not None
        # the gate reads the gateways' reports, which reach the running controller (its API);
        # a rollout command's own passes stop at the checks and leave the verdict to it
        if state.observed and (self.scoped or not self._traffic_gate(state, report)):
            return
        mine = sorted({s.region for s in eligible})
        marked = self.store.update(model, partial(_region_done, version=canary.version, regions=mine))
        needed = set(canary.regions or self.cfg.canary_regions or mine)
        if marked.canary is None or not needed <= set(marked.canary.regions_done):
            report.canary.append(
                f"{model} version {canary.version}: passed in {', '.join(mine)}; waiting for "
                f"{', '.join(sorted(needed - set(marked.canary.regions_done if marked.canary else [])))}"
            )
            return
        promoted = self.store.update(
            model, partial(_promote_canary, version=canary.version, started=canary.started)
        )
        report.canary.append(
            f"{model} version {canary.version} promoted (passed on {len(canary.passed)} servers)"
        )
        logger.info("%s version %d promoted", model, canary.version)
        self.prune(promoted, report)

    def _check_canary_on(
        self,
        state: DesiredState,
        server: ControlledServer,
        card: dict[str, Any],
        configs: CandidateConfigs,
        report: PassReport,
    ) -> bool:
        """Check the candidate on one server under the canary's lease; False stops this pass's checks
        (the canary failed, finished elsewhere, or another controller holds the lease)."""
        model, canary = state.model, state.canary
        assert canary is not None
        claimed = self.store.update(
            model,
            partial(
                DesiredState.canary_claimed,
                me=self.me,
                server=server.name,
                lease_s=self.cfg.lease_s,
                now=time.time(),
            ),
        )
        if (
            claimed.canary is None
            or claimed.canary.version != canary.version
            or claimed.canary.owner != self.me
        ):
            return False
        try:
            summary = self._check_under_lease(server, model, canary.version, claimed.served, card, configs)
        except ControlError as exc:
            self._fail_canary_on(server, model, canary.version, claimed.served, str(exc), report)
            return False
        self.store.update(model, partial(_pass_canary, version=canary.version, server=server.name))
        report.canary.append(f"{server.name}: {model} version {canary.version} {summary}")
        self.canary_log.append(report.canary[-1])
        return True

    def _fail_canary_on(
        self,
        server: ControlledServer,
        model: str,
        version: int,
        served: list[int],
        reason: str,
        report: PassReport,
    ) -> None:
        """Put the server back on the served versions and mark the candidate failed."""
        admin = self.admin(server)
        try:
            admin.load(model)  # back to the served versions (the configs name them)
            action = f"back on version(s) {', '.join(map(str, served))}"
        except ControlError as again:
            action = f"putting it back failed too: {again}"
        finally:
            admin.close()
        self.store.update(model, partial(_fail_canary, version=version, server=server.name, reason=reason))
        report.canary.append(f"{server.name}: {model} version {version} failed: {reason}; {action}")
        self.canary_log.append(report.canary[-1])
        logger.warning("%s: canary of %s version %d failed: %s", server.name, model, version, reason)

    def _traffic_gate(self, state: DesiredState, report: PassReport) -> bool:
        """Judge a canary with a share or shadow on the gateways' reports: True once it passed;
        a failure puts every server back on the served versions."""
        canary = state.canary
        assert canary is not None
        tally = self.traffic.total(state.model, canary.version, canary.started)
        found = verdict(canary, tally, time.time())
        text = f"{found.text}\n{describe(tally)}".strip()
        self.store.update(state.model, partial(_report_canary, version=canary.version, report=text))
        if found.decision == "fail":
            self.store.update(
                state.model,
                partial(_fail_canary, version=canary.version, server="traffic gate", reason=found.text),
            )
            report.canary.append(
                f"{state.model} version {canary.version} failed its traffic gate: {found.text}"
            )
            self.canary_log.append(report.canary[-1])
            logger.warning(
                "%s version %d failed its traffic gate: %s", state.model, canary.version, found.text
            )
            return False
        if found.decision == "wait":
            report.canary.append(f"{state.model} version {canary.version}: {found.text}")
            return False
        report.canary.append(f"{state.model} version {canary.version}: {found.text}")
        return True

    def _check_under_lease(
        self,
        server: ControlledServer,
        model: str,
        version: int,
        served: list[int],
        card: dict[str, Any],
        configs: CandidateConfigs | None = None,
    ) -> str:
        """The canary check, renewing the lease while it runs (a load may outlast the lease)."""
        renew = partial(DesiredState.canary_claimed, me=self.me, server=server.name, lease_s=self.cfg.lease_s)

        def checked() -> str:
            # Its own client, made and closed in the check's thread: tritonclient's HTTP client is
            # bound to the thread that first used it and fails once that thread has exited.
            admin = self.admin(server)
            try:
                return check(admin, model, version, served, card, self.cfg, configs)
            finally:
                admin.close()

        with ThreadPoolExecutor(max_workers=1) as one:
            running = one.submit(checked)
            while True:
                try:
                    return running.result(timeout=self.cfg.lease_s / 3)
                except FutureTimeout:
                    self.store.update(model, partial(renew, now=time.time()))

    # -- hygiene ---------------------------------------------------------------------------------
    def prune(self, state: DesiredState, report: PassReport) -> None:
        """Remove versions neither served, in canary, nor among the newest `keep_versions`."""
        published = self.store.published_versions(state.model)
        keep = set(state.served) | set(published[-self.cfg.keep_versions :])
        if state.canary is not None:
            keep.add(state.canary.version)
        doomed = [v for v in published if v not in keep]
        for v in doomed:
            self.store.remove_version(state.model, v)
            report.removed.append(f"{state.model} version {v}")
        if doomed:
            self.store.update(state.model, partial(DesiredState.removed, versions=doomed))

    # -- loops -----------------------------------------------------------------------------------
    def settle(self, model: str, max_passes: int = 1000) -> DesiredState:
        """Run passes until `model` has no canary (a rollout's end: promoted or failed)."""
        for _ in range(max_passes):
            report = self.reconcile_once()
            state = self.store.current(model)
            if state is None or state.canary is None:
                return state  # type: ignore[return-value]
            elsewhere = set(state.canary.regions) - {s.region for s in self.servers()}
            if (
                report.servers
                and set(report.servers) <= set(state.canary.passed)
                and (state.observed or elsewhere)
            ):
                # checked on every server here: the traffic gate, and the other regions' checks,
                # are for the running controllers
                return state
            if not report.servers:
                raise ControlError(
                    f"no server found to roll {model} version {state.canary.version} onto: check the "
                    "servers, or the region's discovery (DNS name, EndpointSlices)"
                )
            time.sleep(
                self.cfg.interval_s
                if state.canary.held_by_other(self.me, self.cfg.lease_s, time.time())
                else 0
            )
        raise ControlError(f"{model}: rollout did not finish within {max_passes} passes")

    def wake(self) -> None:
        """Run the next pass now (from the loop running `run`)."""
        if self._wake is not None:
            self._wake.set()

    async def run(
        self,
        stop: asyncio.Event,
        on_pass: Callable[[PassReport], None] | None = None,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        """Reconcile every `interval_s` until `stop` is set, while `leading()` (leader election);
        a failing pass is logged, counted and retried."""
        self._wake = asyncio.Event()
        while not stop.is_set():
            self._wake.clear()  # an ask during this pass wakes the loop for the next one at once
            if leading():
                started = time.monotonic()
                try:
                    report = await asyncio.to_thread(self.reconcile_once)
                    self.last_pass_s = time.monotonic() - started
                    if on_pass is not None:
                        on_pass(report)
                except Exception:  # a broken pass must not end reconciliation for the fleet
                    self.failed_passes += 1
                    logger.exception("reconcile pass failed")
            stopping = asyncio.ensure_future(stop.wait())
            woken = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait(
                {stopping, woken}, timeout=self.cfg.interval_s, return_when=asyncio.FIRST_COMPLETED
            )
            stopping.cancel()
            woken.cancel()


# Canary transitions that apply only while the same canary is still on: a rollback or another
# controller's decision in between wins.
def _promote_canary(state: DesiredState, version: int, started: float) -> DesiredState:
    """Promote only the canary that was checked (a canary restarted since has its own passes)."""
    same = state.canary is not None and state.canary.version == version and state.canary.started == started
    return state.promote(version) if same else state


def _report_canary(state: DesiredState, version: int, report: str) -> DesiredState:
    return state.canary_reported(report) if state.canary and state.canary.version == version else state


def traffic_plans(states: Iterable[DesiredState]) -> dict[str, dict[str, Any]]:
    """What gateways do for each model in canary: pin unversioned requests to the stable version,
    answer `share` of clients from the canary, mirror `shadow` of requests to it."""
    plans: dict[str, dict[str, Any]] = {}
    for state in states:
        canary = state.canary
        if canary is None or not state.served:
            continue
        plans[state.model] = {
            "stable": max(state.served),
            "canary": canary.version,
            "share": canary.share,
            "shadow": canary.shadow,
            "started": canary.started,
        }
    return plans


def lingering_pins(
    states: dict[str, DesiredState],
    observed: Iterable[list[dict[str, Any]]],
    plans: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Pins (no share, no shadow) for models whose canary ended while some server still has a
    version loaded that is not served: until it is unloaded, an unversioned request would get
    Triton's newest loaded version, the failed candidate."""
    held: dict[str, set[int]] = {}
    for stats in observed:
        for model, versions in loaded_versions(stats).items():
            held.setdefault(model, set()).update(versions)
    return {
        model: stable_pin(state)
        for model, state in states.items()
        if model not in plans and state.served and held.get(model, set()) - set(state.served)
    }


def ended_pins(
    states: dict[str, DesiredState],
    previous: dict[str, dict[str, Any]],
    plans: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Pins for models the gateways followed a plan or pin for last pass and no longer do: kept
    until the pass has observed the servers (`lingering_pins` then says whether they still hold
    a version that is not served)."""
    return {
        model: stable_pin(states[model])
        for model in previous
        if model not in plans and model in states and states[model].served
    }


def stable_pin(state: DesiredState) -> dict[str, Any]:
    """A plan that only pins unversioned requests to the served version."""
    stable = max(state.served)
    return {"stable": stable, "canary": stable, "share": 0.0, "shadow": 0.0, "started": 0.0}


def _region_done(state: DesiredState, version: int, regions: list[str]) -> DesiredState:
    return state.canary_region_done(regions) if state.canary and state.canary.version == version else state


def _fail_canary(state: DesiredState, version: int, server: str, reason: str) -> DesiredState:
    return state.canary_failed(server, reason) if state.canary and state.canary.version == version else state


def _pass_canary(state: DesiredState, version: int, server: str) -> DesiredState:
    return state.canary_passed(server) if state.canary and state.canary.version == version else state
