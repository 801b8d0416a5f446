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
from typing import TYPE_CHECKING

from gateway.config import TrafficConfig
from gateway.fleet.traffic_tally import MAX_CLASSES, ClassTally

if TYPE_CHECKING:
    from gateway.fleet.traffic import Plan

logger = logging.getLogger(__name__)
RECOMPUTE_EVERY = 32  # observations between two water-fillings
OTHER_CLASS = "__other__"  # past MAX_CLASSES distinct classes

Classes = list[str] | None
Mirror = Callable[[], Awaitable[Classes]]


def water_fill(freqs: dict[str, float], share: float) -> dict[str, float]:
    """Per class, the probability of mirroring it so that the mirrored share is `share` and spread
    as evenly over classes as it allows."""
    if share >= 1.0 or not freqs:
        return dict.fromkeys(freqs, 1.0)
    ordered = sorted(freqs.items(), key=lambda kv: kv[1])
    remaining, level = share, None
    for i, (_, f) in enumerate(ordered):
        left = len(ordered) - i
        if f * left >= remaining:
            level = remaining / left
            break
        remaining -= f
    if level is None:
        return dict.fromkeys(freqs, 1.0)
    return {c: min(1.0, level / f) if f > 0 else 1.0 for c, f in freqs.items()}


class ClassSampler:
    """Class frequencies of the stable answers, and the mirroring probability each gets."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.total = 0
        self._probs: dict[str, float] = {}
        self._share = -1.0
        self._since = 0

    def observe(self, classes: list[str]) -> None:
        for c in classes:
            self.seen[c] = self.seen.get(c, 0) + 1
        self.total += len(classes)
        self._since += len(classes)

    def probability(self, cls: str, share: float) -> float:
        if cls not in self._probs or share != self._share or self._since >= RECOMPUTE_EVERY:
            self._probs = water_fill({c: n / self.total for c, n in self.seen.items()}, share)
            self._share, self._since = share, 0
        return self._probs.get(cls, 1.0)


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
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

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
