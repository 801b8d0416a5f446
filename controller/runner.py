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

from controller.config import ControllerConfig
from controller.demand_api import DemandApi
from controller.fleet import ControlledServer, FleetSpec, ServerSet
from controller.reconcile import Controller, PassReport
from controller.state_store import StateStore

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
    ) -> None:
        self.fleet = ServerSet(gateway_cfg)
        self.regions = regions
        self.controller = Controller(store, self.servers, key, cfg)
        self.reconcile = reconcile
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

    def start(self) -> ControllerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.fleet.start(), self._loop).result(timeout=60)
        if self.reconcile:
            self._runner: Future[None] = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        return self

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        await self.controller.run(self._stop, self._passed)

    def _passed(self, report: PassReport) -> None:
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

    def serve_demand(self, host: str, port: int) -> int:
        """Start the demand API (gateway cold starts) on the controller's loop; its port."""
        self.demand_api = DemandApi(self)
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
