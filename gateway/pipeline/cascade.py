"""A cascade's answer: the first stage answers when its answer passes the stage's deferral rule,
otherwise the same request goes to the next stage (docs/cascade.md).

The step runs where `forward.send` would (dispatch), so a cascade's request is admitted, keyed,
cached and coalesced like any other: its cache key is filed under `resolved` below, which names
every rule's version and digest and every stage's model version, so an answer chosen under one rule
is never served under another. Each stage has its own deadline within the request's; a stage that
fails (no server, an error, its deadline) passes the request on. When no later stage answers, the
latest answer an earlier stage gave is returned, marked `offline`: never an error when an answer
exists, and never stored (the next request asks the later stage again).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeVar

from gateway.errors import BadRequest, GatewayError, UpstreamRejected, UpstreamTimeout
from gateway.fleet.cascade import Cascade, Mark, Stage
from gateway.pipeline.call import Call, Request

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.router import Route

logger = logging.getLogger(__name__)
A = TypeVar("A")


def choose(gw: Gateway, call: Call) -> None:
    """Whether the request names a cascade; a cascade has no versions of its own."""
    cascade = gw.cascades.get(call.model)
    if cascade is None:
        return
    if call.version:
        raise BadRequest(
            f"{call.model!r} is a cascade of {[s.model for s in cascade.stages]}: it has no versions; "
            "send the request without one"
        )
    call.cascade = cascade


def resolved(gw: Gateway, cascade: Cascade) -> str:
    """What a cascade's answer is filed under: its rules, and each stage's model version now."""
    stages = ",".join(
        f"{s.name}={s.model}@{'remote' if s.remote is not None else gw.router.latest_version(s.model)}"
        for s in cascade.stages
    )
    return f"cascade/{cascade.tag}/{stages}"


async def fetch(gw: Gateway, call: Call, request: Request[A]) -> tuple[A, bytes | None]:
    """The answer and what to store of it (cached.answer's fetch): an offline answer is not stored."""
    answer = await send(gw, call, request, shared=True)
    mark = call.mark
    if mark is None or mark.offline or not request.succeeded(answer):
        return answer, None
    return answer, request.storable(answer, None)


async def send(gw: Gateway, call: Call, request: Request[A], shared: bool = False) -> A:
    """Stage by stage until one's answer is kept (or the last answers); the answer marked."""
    cascade = call.cascade
    assert cascade is not None
    best: tuple[A, Stage, Route | None] | None = None  # the latest answer a stage gave
    kept = False  # the rule kept it, or the last stage gave it
    score: float | None = None  # the rule's score on the latest answer it judged
    refusal: A | None = None  # Triton refused the request itself (HTTP 4xx): its words, if nothing else
    error: GatewayError | None = None
    for stage in cascade.stages:
        try:
            answer, route = await _ask(gw, call, request, stage, shared)
        except GatewayError as exc:
            if isinstance(exc, UpstreamRejected) or not isinstance(error, UpstreamRejected):
                error = exc  # the request's own fault outranks a stage being away
            logger.info("cascade %s: stage %s failed, escalating: %s", cascade.name, stage.name, exc.message)
            continue
        if not request.succeeded(answer):
            refusal = answer
            continue
        best = (answer, stage, route)
        if stage.rule is None:  # the last stage: its answer stands
            kept = True
            break
        probabilities = request.output(answer, stage.rule.output)
        verdict = None if probabilities is None else stage.rule.judge(probabilities)
        if verdict is None:
            logger.warning(
                "cascade %s: stage %s's answer has no %r output of %d classes to judge; escalating",
                cascade.name,
                stage.name,
                stage.rule.output,
                len(stage.rule.classes),
            )
            continue
        score = verdict.score
        if verdict.keep:
            kept = True
            break
    if best is None:
        if refusal is not None:
            return refusal
        assert error is not None
        raise error
    answer, stage, route = best
    call.mark, call.route = Mark(stage.name, score, cascade.tag, offline=not kept), route
    return request.marked(answer, call.mark)


async def _ask(
    gw: Gateway, call: Call, request: Request[A], stage: Stage, shared: bool
) -> tuple[A, Route | None]:
    """One stage's answer within its deadline (and the request's)."""
    deadline = call.deadline
    if stage.cfg.deadline_s is not None:
        deadline = min(deadline, gw.clock() + stage.cfg.deadline_s)
    attempt = request.attempt(shared=shared, model=stage.model, headers=stage.headers)
    if stage.remote is not None:
        left = deadline - gw.clock()
        if left <= 0:
            raise UpstreamTimeout(f"stage {stage.name}: no time left before its deadline")
        return await attempt(stage.remote, left), None
    outcome = await gw.send(stage.model, "", stage.cfg.region or call.pinned, deadline, attempt)
    return outcome.value, outcome.route
