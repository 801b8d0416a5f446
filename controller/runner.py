"""The controller in a background thread: discovery on its own event loop, reconcile passes beside it.

Used by `skewserve controller` (the loop, in the foreground), `skewserve up` (the same loop inside the
local stack) and `skewserve rollout` / `rollback` (discovery only, passes run by the command).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from controller.api_auth import CallerTokens
from controller.config import ControllerConfig
from controller.demand_api import DemandApi
from controller.fleet import ControlledServer, FleetSpec, ServerSet
from controller.leader import LeaderElection, LeaseRecords
from controller.metrics import ControllerMetrics
from controller.reconcile import Controller, PassReport
from gateway.task_stop import cancel_and_wait
from repository.state_store import StateStore

logger = logging.getLogger(__name__)


class ControllerThread:
    def __init__(
        self,
        gateway_cfg: FleetSpec,
        store: StateStore,
        key: str,
        cfg: ControllerConfig | None = None,
        regions: set[str] | None = None,
        reconcile: bool = True,
        leader_election: bool = False,
        lease_records: LeaseRecords | None = None,
    ) -> None:
        """`lease_records`: where the leader's lease lives with `leader_election` (default: a record
        in the repository's store; controller/kube_lease.py keeps it in a Kubernetes Lease)."""
        self.fleet = ServerSet(gateway_cfg)
        self.fleet_regions = {r.name for r in gateway_cfg.regions}
        self.regions = regions
        self.controller = Controller(store, self.servers, key, cfg)
        self.metrics = ControllerMetrics()
        self.metrics.track_failed_passes(lambda: self.controller.failed_passes)
        self.metrics.follow_leader(lambda: self.leading)
        # one lease per set of regions: each region's controllers elect their own leader
        scope = "-".join(sorted(regions)) if regions else "all"
        self.election = (
            LeaderElection(
                lease_records or store, self.controller.me, scope, self.controller.cfg.leader_lease_s
            )
            if leader_election
            else None
        )
        self.reconcile = reconcile
        self._announced = False  # the role last logged: leading may lapse by the clock between attempts
        self.passes = 0
        self.last_report: PassReport | None = None
        self._first_pass = threading.Event()
        self._pass_done: asyncio.Event | None = None  # set (and replaced) after each pass, in the loop
        self.demand_api: DemandApi | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="controller", daemon=True)
        self.on_pass: Callable[[PassReport], None] | None = None

    def servers(self) -> list[ControlledServer]:
        found = self.fleet.snapshot()
        return [s for s in found if self.regions is None or s.region in self.regions]

    @property
    def leading(self) -> bool:
        """Whether this replica reconciles (always, without leader election)."""
        return self.election is None or self.election.leading

    def alive(self) -> bool:
        runner = getattr(self, "_runner", None)
        return self._thread.is_alive() and (runner is None or not runner.done())

    def health_text(self) -> str:
        role = "leader" if self.leading else "standby"
        return f"{role}; {self.passes} passes; loop {'running' if self.alive() else 'stopped'}"

    def start(self) -> ControllerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.fleet.start(), self._loop).result(timeout=60)
        if self.reconcile:
            self._runner: Future[None] = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        return self

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        campaign = None
        if self.election is not None:
            await self._campaign_once()
            campaign = asyncio.ensure_future(self._campaign(self._stop))
        try:
            await self.controller.run(self._stop, self._passed, lambda: self.leading)
        finally:
            if campaign is not None:
                await cancel_and_wait(campaign)
            if self.election is not None:
                await asyncio.to_thread(self.election.release)

    async def _campaign_once(self) -> None:
        assert self.election is not None
        now = await asyncio.to_thread(self.election.attempt)
        if now != self._announced:
            self._announced = now
            logger.info("%s is %s", self.controller.me, "the leader" if now else "a standby")
            if now:
                self.controller.wake()  # reconcile now: the previous leader's pass may be long gone

    async def _campaign(self, stop: asyncio.Event) -> None:
        """Renew (or try to take) the lease beside the passes: a long pass never lets it lapse."""
        assert self.election is not None
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.election.renew_every_s)
            except asyncio.TimeoutError:
                pass
            if not stop.is_set():
                await self._campaign_once()

    def _passed(self, report: PassReport) -> None:
        self.metrics.observe(report, self.controller.last_pass_s)
        self.passes += 1
        self.last_report = report
        self._first_pass.set()
        if self._pass_done is not None:
            self._pass_done.set()
            self._pass_done = None
        if self.on_pass is not None:
            self.on_pass(report)

    async def next_pass(self, timeout_s: float) -> PassReport | None:
        """The report of the next pass to end (in the controller's loop), or None after `timeout_s`."""
        if self._pass_done is None:
            self._pass_done = asyncio.Event()
        try:
            await asyncio.wait_for(self._pass_done.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.last_report

    def serve_demand(self, host: str, port: int, tokens: CallerTokens | None = None) -> int:
        """Start the controller's API (traffic reports, cold starts, probes, metrics) on its loop;
        its port. With `tokens`, /v1/ calls need a caller's bearer token."""
        self.demand_api = DemandApi(self, tokens=tokens, regions=self.fleet_regions)
        return asyncio.run_coroutine_threadsafe(self.demand_api.start(host, port), self._loop).result(
            timeout=30
        )

    def wait_first_pass(self, timeout_s: float) -> bool:
        return self._first_pass.wait(timeout_s)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            try:
                self._runner.result(timeout=self.controller.cfg.load_timeout_s + 10)
            except Exception:  # stopping: a pass's error was logged by the loop already
                logger.debug("controller loop ended with an error", exc_info=True)
        if self.demand_api is not None:
            asyncio.run_coroutine_threadsafe(self.demand_api.stop(), self._loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(self.fleet.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
