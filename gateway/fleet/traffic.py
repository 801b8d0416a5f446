"""Traffic of models in canary, as the controller's desired state says (controller/demand_api.py).

For a model in canary every unversioned request is pinned to a version: without a pin, Triton
answers from the newest version a server has loaded, and a server that passed the canary check
holds the canary beside the stable version. A `share` of clients, chosen by a hash of the client's
key (so each client stays on one side), is answered by the canary; the rest by the stable version.
A version no server lists ready yet (the canary before its first server passed, a promotion under
way) is not chosen: the request goes to what is ready, never to a 503.

Tallies per role (stable, canary, shadow) and per class go back to the controller with each poll;
they are cumulative per canary, and the controller's traffic gate judges them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from gateway.config import TrafficConfig
from gateway.fleet.controller_token import ControllerToken
from gateway.fleet.traffic_plan import Plan
from gateway.fleet.traffic_tally import ModelTally, Role, TrafficReport
from gateway.task_stop import cancel_and_wait

logger = logging.getLogger(__name__)
_HASH_SPACE = float(1 << 64)


class Traffic:
    def __init__(self, cfg: TrafficConfig, listed: Callable[[str, str], bool], region: str) -> None:
        self.cfg = cfg
        # Whether some server has a version of a model ready (RegionRouter.listed: an index, not a
        # walk of the fleet per request).
        self._listed = listed
        self.region = region
        self.plans: dict[str, Plan] = {}
        self.reporter = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.polls = 0
        self.poll_errors = 0
        self._session: aiohttp.ClientSession | None = None
        self.token = ControllerToken(cfg.token_file)
        self._task: asyncio.Task[None] | None = None

    # -- the hot path ----------------------------------------------------------------------------
    def choose(self, model: str, version: str, client_key: str) -> tuple[str, Plan | None, Role | None]:
        """The version to ask for, and the plan and role to record the answer under."""
        if version or not self.plans:
            return version, None, None
        plan = self.plans.get(model)
        if plan is None:
            return version, None, None
        if (
            plan.share > 0
            and self.bucket(model, client_key) < plan.share
            and self._listed(model, plan.canary)
        ):
            return plan.canary, plan, "canary"
        # Pinned even while no server lists the stable version (a reload under way): unpinned,
        # Triton would answer from its newest loaded version, the candidate.
        return plan.stable, plan, "stable"

    def stable_pin(self, model: str, version: str) -> str:
        """For streams and generate (no share, no shadow): the stable version of a model in canary
        when the request names none, else the version as sent."""
        if version or not self.plans:
            return version
        plan = self.plans.get(model)
        return plan.stable if plan is not None else version

    def stable_listed(self, model: str, version: str) -> bool:
        return self._listed(model, version)

    @staticmethod
    def bucket(model: str, client_key: str) -> float:
        """The client's fixed place in [0, 1) for this model."""
        digest = hashlib.blake2b(f"{model}\0{client_key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / _HASH_SPACE

    @staticmethod
    def record(plan: Plan, role: Role, seconds: float, ok: bool) -> None:
        plan.tally.roles[role].observe(seconds, ok)

    # -- following the controller ----------------------------------------------------------------
    async def start(self) -> None:
        await self.token.headers()  # a missing or empty token file stops the start, named
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="traffic-follow")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._session is not None:
            await self._session.close()

    async def _follow(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the controller away: keep the plans we have, try again
                self.poll_errors += 1
                logger.warning("traffic plans not read from %s: %s", self.cfg.controller_url, exc)
            await asyncio.sleep(self.cfg.poll_s)

    def report(self) -> TrafficReport:
        return TrafficReport(
            reporter=self.reporter,
            region=self.region,
            models={m: p.tally for m, p in self.plans.items()},
        )

    async def poll(self) -> None:
        assert self._session is not None
        body = self.report().model_dump_json().encode()
        headers = {"content-type": "application/json", **await self.token.headers()}
        async with self._session.post(
            f"{self.cfg.controller_url}/v1/traffic", data=body, headers=headers
        ) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {answer.get('reason', '')}")
        self.apply(answer.get("models", {}))
        self.polls += 1

    def apply(self, plans: dict[str, Any]) -> None:
        """Take the controller's plans; a plan for the same canary keeps its tallies and classes."""
        fresh: dict[str, Plan] = {}
        for model, p in plans.items():
            version, started = int(p["canary"]), float(p["started"])
            old = self.plans.get(model)
            if old is not None and old.canary == str(version) and old.started == started:
                old.share, old.shadow, old.stable = float(p["share"]), float(p["shadow"]), str(p["stable"])
                fresh[model] = old
                continue
            fresh[model] = Plan(
                model,
                str(p["stable"]),
                str(version),
                float(p["share"]),
                float(p["shadow"]),
                started,
                ModelTally(version=version, started=started),
            )
        self.plans = fresh

    def describe(self) -> dict[str, Any]:
        return {
            "controller": self.cfg.controller_url,
            "polls": self.polls,
            "poll_errors": self.poll_errors,
            "models": {
                m: {"stable": p.stable, "canary": p.canary, "share": p.share, "shadow": p.shadow}
                for m, p in self.plans.items()
            },
        }
