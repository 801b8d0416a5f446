"""Shadow traffic, stratified by class: a share of requests is sent again to the candidate version
after the client has its answer, and the two answers' classes are compared.

The client's answer is sent before anything here runs, and never replaced: the mirror is a task of
its own, bounded per worker (`traffic.shadow_max_inflight`; past it a request is counted as skipped,
not queued), and its answer is only read for its class.

Uniform sampling (Envoy's request mirroring, KServe and Seldon shadows) mirrors each class in
proportion to its traffic, so on skewed traffic the rare classes, where a new version most often
differs, barely reach the candidate. Here the mirrored share is spread as evenly over classes as
the share allows (water-filling): with class frequencies f and share s, class c is mirrored with
probability min(1, λ/f_c), where λ makes the expected mirrored share equal s. A class seen for the
first time is always mirrored.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from gateway.config import TrafficConfig
from gateway.fleet.traffic_plan import Plan
from gateway.fleet.traffic_tally import MAX_CLASSES, ClassTally
from gateway.task_stop import cancel_all_and_wait

logger = logging.getLogger(__name__)
OTHER_CLASS = "__other__"  # past MAX_CLASSES distinct classes

Classes = list[str] | None
Mirror = Callable[[], Awaitable[Classes]]


class Shadow:
    def __init__(
        self, cfg: TrafficConfig, clock: Callable[[], float], rng: Callable[[], float] = random.random
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.rng = rng
        self.inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def offer(self, plan: Plan, stable: Callable[[], Classes], mirror: Mirror, size: int) -> None:
        """Consider one answered request for mirroring (called after the client's answer is sent)."""
        if plan.shadow <= 0:
            return
        if size > self.cfg.shadow_max_bytes or self.inflight >= self.cfg.shadow_max_inflight:
            plan.tally.skipped += 1
            return
        self.inflight += 1
        task = asyncio.get_running_loop().create_task(self._run(plan, stable, mirror))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.inflight -= 1
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("shadow request failed", exc_info=task.exception())

    async def close(self) -> None:
        await cancel_all_and_wait(list(self._tasks))

    @staticmethod
    def _class_tally(plan: Plan, cls: str) -> ClassTally:
        classes = plan.tally.classes
        tally = classes.get(cls)
        if tally is None:
            if len(classes) >= MAX_CLASSES - 1:
                cls = OTHER_CLASS
            tally = classes.setdefault(cls, ClassTally())
        return tally

    async def _run(self, plan: Plan, stable: Callable[[], Classes], mirror: Mirror) -> None:
        wanted = stable()
        if not wanted:
            return
        tallies = [self._class_tally(plan, c) for c in wanted]
        for t in tallies:
            t.seen += 1
        plan.sampler.observe(wanted)
        chance = max(plan.sampler.probability(c, plan.shadow) for c in wanted)
        if self.rng() >= chance:
            return
        for t in tallies:
            t.mirrored += 1
        started = self.clock()
        try:
            got = await mirror()
        except Exception as exc:  # the candidate's failure is a tally, never the client's
            logger.debug("shadow request to %s version %s failed: %s", plan.model, plan.canary, exc)
            got = None
        ok = got is not None and len(got) == len(wanted)
        plan.tally.roles["shadow"].observe(self.clock() - started, ok)
        if got is None or not ok:
            for t in tallies:
                t.error += 1
            return
        for t, want, have in zip(tallies, wanted, got, strict=True):
            if want == have:
                t.agree += 1
            else:
                t.disagree += 1
