"""The controller's API for gateways: demand for a model no server holds (gateway/fleet/cold_start.py),
and the traffic of models in canary (gateway/fleet/traffic.py).

`POST /v1/demand {"model": NAME}` records the demand, runs a reconcile pass at once (placement
gives the model a copy: one load in the whole fleet, however many gateways ask) and answers when
that pass ended: `ready` (some server holds it), `unplaced` with the reason (larger than any server,
at once; no room without evicting models in use or worth more, once the passes within the wait found
none), `loading` (not done within the wait) or `unknown` (404: the
repository has no such model). Bodies are bounded and names checked before anything is done.

`POST /v1/traffic` takes a gateway worker's cumulative tallies of canaries (gateway/fleet/traffic_tally.py)
and answers with what every gateway should do for each model in canary: the stable version to pin
unversioned requests to, the canary's share of clients and the share of requests to mirror.

Both need `Authorization: Bearer <token>` when the controller has callers' tokens
(controller/api_auth.py; required unless it listens on loopback only). What a caller sends is
bounded: asks name a model of the repository and a region of the fleet, reports keep only tallies
of canaries running now, filed under the caller. A standby replica (leader election) answers 503
`standby`. `/healthz`, `/readyz` (the leader, ready to reconcile) and `/metrics` need no token.

`GET /v1/servers/ready?server=NAME-OR-HOST` answers whether a server serves what the desired state
wants on it (controller/server_readiness.py): the startup gate of the Triton pods.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from controller.api_auth import CallerTokens
from controller.server_readiness import find
from controller.traffic_gate import ReportRefused
from gateway.fleet.traffic_tally import TrafficReport

logger = logging.getLogger(__name__)
MAX_BODY = 4096
MAX_REPORT_BODY = 4 << 20
MODELS_TTL_S = 5.0
CALLER = web.RequestKey("caller", str)
MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class DemandApi:
    def __init__(
        self,
        thread: Any,
        wait_s: float = 30.0,
        tokens: CallerTokens | None = None,
        regions: set[str] | None = None,
    ) -> None:
        self.thread = thread  # controller.runner.ControllerThread
        self.wait_s = wait_s
        self.tokens = tokens
        self.regions = regions  # the fleet's regions: an ask naming another is refused
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._models_cache: set[str] = set()
        self._listed_at: float | None = None
        self.asks = 0

    async def _models(self) -> set[str]:
        """The repository's models, listed at most every MODELS_TTL_S (on S3 a listing costs a
        request: asks for invented names must not turn into one listing each)."""
        loop = asyncio.get_running_loop()
        if self._listed_at is None or loop.time() - self._listed_at > MODELS_TTL_S:
            self._models_cache = set(await asyncio.to_thread(self.thread.controller.store.models))
            self._listed_at = loop.time()
        return self._models_cache

    async def start(self, host: str, port: int) -> int:
        app = web.Application(client_max_size=MAX_REPORT_BODY, middlewares=[self._admit])
        app.router.add_post("/v1/demand", self.demand)
        app.router.add_post("/v1/traffic", self.traffic)
        app.router.add_get("/v1/servers/ready", self.server_ready)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @web.middleware
    async def _admit(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The caller's token on /v1/ (its name in request["caller"]); standbys refuse the API."""
        if not request.path.startswith("/v1/"):
            return await handler(request)
        caller = "local"
        if self.tokens is not None:
            found = self.tokens.caller(request.headers.get("Authorization"))
            if found is None:
                response = self._answer(
                    401,
                    "unauthorized",
                    "send the caller's token as `Authorization: Bearer <token>` (the gateway's "
                    "traffic.token_file / cold_start.token_file, one of the controller's --tokens-dir)",
                )
                response.headers["WWW-Authenticate"] = 'Bearer realm="skewserve-controller"'
                return response
            caller = found
        if not self.thread.leading:
            return self._answer(503, "standby", "this controller replica is a standby; ask the leader")
        request[CALLER] = caller
        return await handler(request)

    async def healthz(self, _request: web.Request) -> web.Response:
        alive = self.thread.alive()
        return self._answer(200 if alive else 503, "alive" if alive else "stuck", self.thread.health_text())

    async def readyz(self, _request: web.Request) -> web.Response:
        if not self.thread.leading:
            return self._answer(503, "standby", "not the leader: reconciling is another replica's")
        if self.thread.passes == 0:
            return self._answer(503, "starting", "no reconcile pass finished yet")
        return self._answer(200, "leader", f"{self.thread.passes} passes")

    async def metrics(self, _request: web.Request) -> web.Response:
        body, content_type = self.thread.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    @staticmethod
    def _answer(status: int, state: str, reason: str = "") -> web.Response:
        return web.json_response({"state": state, "reason": reason}, status=status)

    async def demand(self, request: web.Request) -> web.Response:
        self.asks += 1
        try:
            raw = await request.read()
            if len(raw) > MAX_BODY:
                raise ValueError("too large")
            body = json.loads(raw)
            model = body.get("model") if isinstance(body, dict) else None
            region = body.get("region", "") if isinstance(body, dict) else ""
        except (ValueError, web.HTTPRequestEntityTooLarge):
            return self._answer(
                400, "invalid", f'the body must be JSON {{"model": NAME}} of at most {MAX_BODY} bytes'
            )
        if not isinstance(model, str) or not MODEL_NAME.match(model):
            return self._answer(400, "invalid", "model must be a model name (letters, digits, _ . -)")
        controller = self.thread.controller
        if model not in await self._models():
            return self._answer(404, "unknown", f"{model} is not in the repository")
        if not isinstance(region, str) or (
            region and self.regions is not None and region not in self.regions
        ):
            known = ", ".join(sorted(self.regions or ()))
            return self._answer(
                400, "invalid", f"region must be one of the fleet's regions ({known}) or empty"
            )
        state = await asyncio.to_thread(controller.store.current, model)
        if state is None or not state.served:
            return self._answer(503, "unplaced", f"no version of {model} is served: roll one out first")
        controller.request_demand(model, region)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        unplaced = ""
        while loop.time() < deadline:
            report = await self.thread.next_pass(deadline - loop.time())
            if report is None:
                break
            if any(model in held for held in report.placement.values()) and not any(
                f": {model} " in f for f in report.failures
            ):
                return self._answer(200, "ready")
            if model in report.unfit:
                return self._answer(503, "unplaced", report.unplaced[model])
            # no room now (every model in recent use): a later pass may find one gone idle
            unplaced = report.unplaced.get(model, unplaced)
        if unplaced:
            return self._answer(503, "unplaced", unplaced)
        return self._answer(202, "loading", f"{model} is not loaded after {self.wait_s:.0f}s")

    async def server_ready(self, request: web.Request) -> web.Response:
        """200 once the server (`?server=` its name or its HTTP host) had loaded, when the last pass
        looked, every version the desired state wants on it; 503 `loading` with what it lacks; 404
        `unknown` for a server the last pass did not reach (a new pod not discovered yet)."""
        who = request.query.get("server", "")
        if not who or len(who) > 300:
            return self._answer(
                400, "invalid", "name the server: ?server=REGION/NAME or its HTTP host (a pod's IP)"
            )
        found = find(self.thread.controller.readiness, who)
        if found is None:
            return self._answer(404, "unknown", f"{who} is not among the servers the last pass reached")
        body = {"state": "ready" if found.ready else "loading", **found.as_json()}
        return web.json_response(body, status=200 if found.ready else 503)

    async def traffic(self, request: web.Request) -> web.Response:
        try:
            raw = await request.read()
            report = await asyncio.to_thread(TrafficReport.model_validate_json, raw)
        except web.HTTPRequestEntityTooLarge:
            return self._answer(413, "invalid", f"a traffic report is at most {MAX_REPORT_BODY} bytes")
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return self._answer(400, "invalid", f"traffic report: {where}: {first['msg']}")
        controller = self.thread.controller
        plans = controller.traffic_plans
        running = {m: (int(p["canary"]), float(p["started"])) for m, p in plans.items()}
        try:
            controller.traffic.add(report, request[CALLER], running)
        except ReportRefused as exc:
            return self._answer(429, "refused", str(exc))
        return web.json_response({"models": plans})
