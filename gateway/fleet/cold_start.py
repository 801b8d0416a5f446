"""Cold models on demand: a request for a model no server holds asks the controller to load it
(controller/demand_api.py), waits for the load within its own deadline, then is routed as usual.

Per worker, the requests for one model share one ask (the controller places one copy in the whole
fleet however many gateways ask); at most `max_waiting` requests wait at once. When the controller
cannot place the model (no room without evicting models in use or worth more), the answer is a 503
with Retry-After and the controller's reason. A name the controller does not know goes on to Triton,
which answers in its own words.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from gateway.config import ColdStartConfig
from gateway.errors import Overloaded
from gateway.fleet.controller_token import ControllerToken, ControllerTokenError
from gateway.fleet.health import HealthChecker
from gateway.upstream.server import UpstreamServer

UNKNOWN_TTL_S = 10.0
UNKNOWN_NAMES_KEPT = 1024


@dataclass(frozen=True)
class DemandAnswer:
    state: str  # ready | loading | unplaced | unknown
    reason: str = ""


class ColdStart:
    def __init__(
        self,
        cfg: ColdStartConfig,
        servers: Callable[[], list[UpstreamServer]],
        health: HealthChecker,
        region: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.region = region
        self.servers = servers
        self.health = health
        self.clock = clock
        self.waiting = 0
        self.asks = 0
        self._asking: dict[str, asyncio.Task[DemandAnswer]] = {}
        self._unknown: dict[str, float] = {}  # names the controller does not know -> until when
        self._session: aiohttp.ClientSession | None = None
        self.token = ControllerToken(cfg.token_file)

    def _busy(self, message: str) -> Overloaded:
        return Overloaded(message, headers={"retry-after": str(self.cfg.retry_after_s)})

    def listed_anywhere(self, model: str) -> bool:
        """Some server was last probed holding `model` (ejected, busy or not): no cold start then;
        a version no server holds is Triton's answer, not a load."""
        return any(model in s.ready_models for s in self.servers())

    def ready_somewhere(self, model: str) -> bool:
        now = self.clock()
        return any(model in s.ready_models and s.available(now) for s in self.servers())

    async def wait_ready(self, model: str, deadline: float) -> bool:
        """True once some server holds `model` ready; False when the controller does not know the
        model. Overloaded (503, Retry-After) when it cannot be loaded in time or at all."""
        if self.waiting >= self.cfg.max_waiting:
            raise self._busy(
                f"{self.waiting} requests already wait for models to load "
                f"(cold_start.max_waiting is {self.cfg.max_waiting}); retry later"
            )
        self.waiting += 1
        try:
            if self._unknown.get(model, 0.0) > self.clock():
                return False  # the controller said so a moment ago: no new ask for invented names
            task = self._asking.get(model)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._ask(model))
                self._asking[model] = task
                task.add_done_callback(functools.partial(self._asked, model))
            limit = min(deadline, self.clock() + self.cfg.wait_s)
            try:
                answer = await asyncio.wait_for(asyncio.shield(task), max(0.0, limit - self.clock()))
            except asyncio.TimeoutError:
                raise self._busy(f"model {model} is still loading; retry") from None
            if answer.state not in ("ready", "loading", "unplaced"):  # unknown, invalid: Triton answers
                if len(self._unknown) >= UNKNOWN_NAMES_KEPT:
                    self._unknown.clear()  # bounded whatever names clients invent
                self._unknown[model] = self.clock() + UNKNOWN_TTL_S
                return False
            if answer.state == "unplaced":
                raise self._busy(f"model {model} cannot be loaded now: {answer.reason}")
            if answer.state == "loading":
                raise self._busy(f"model {model} is still loading; retry")
            while not self.ready_somewhere(model):
                remaining = limit - self.clock()
                if remaining <= 0:
                    raise self._busy(f"model {model} is still loading; retry")
                await self.health.next_round(remaining)
            return True
        finally:
            self.waiting -= 1

    def _asked(self, model: str, _task: asyncio.Task[DemandAnswer]) -> None:
        self._asking.pop(model, None)

    async def _ask(self, model: str) -> DemandAnswer:
        self.asks += 1
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.wait_s + 5))
        try:
            async with self._session.post(
                f"{self.cfg.controller_url}/v1/demand",
                json={"model": model, "region": self.region},
                headers=await self.token.headers(),
            ) as resp:
                body = await resp.read()
        except ControllerTokenError as exc:
            raise self._busy(f"the gateway cannot ask the model controller: {exc}") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._busy(
                f"the model controller at {self.cfg.controller_url} did not answer: {exc}"
            ) from exc
        try:
            data = json.loads(body)
            answer = DemandAnswer(str(data.get("state", "")), str(data.get("reason", "")))
        except (ValueError, AttributeError):
            raise self._busy(f"the model controller answered {resp.status} with no demand state") from None
        if answer.state == "ready":
            await self.health.probe_all()  # see the new copy now, not at the next interval
        return answer

    async def close(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
