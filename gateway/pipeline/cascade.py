"""A cascade's answer: the first stage answers when its answer passes the stage's deferral rule,
otherwise the same request goes to the next stage (docs/cascade.md).

The step runs where `forward.send` would (dispatch), so a cascade's request is admitted, keyed,
cached and coalesced like any other: its cache key is filed under `resolved` below, which names
every rule's version and digest and every stage's model version, so an answer chosen under one rule
is never served under another. Each stage has its own deadline within the request's; a stage that
fails (no server, an error, its deadline) passes the request on. When no later stage answers, the
latest answer an earlier stage gave is returned, marked `offline`: never an error when an answer
exists, and never stored (the next request asks the later stage again).

Each run of the stages is counted (docs/cascade.md#metrics): every stage call's time and outcome,
the request's bytes sent on to each later stage, each judged item's predicted class and whether it
escalated, and the answer's stage. A cache hit or a coalesced follower runs no stage and is not
counted here (the cache's own metrics count it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final, TypeVar

from gateway.errors import (
    BadRequest,
    GatewayError,
    RetryableUpstream,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
)
from gateway.fleet.cascade import Cascade, Mark, Stage
from gateway.pipeline.call import Call, Request

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.router import Route

logger: Final = logging.getLogger(__name__)
A = TypeVar("A")
UNJUDGED: Final = "__unjudged__"  # the class label of an escalation the rule could not judge (no such output)


def choose(gw: Gateway, call: Call) -> None:
    """Whether the request names a cascade; a cascade has no versions of its own (a canary plan on
    a model of the same name never applies to it: its stages are pinned each on its own)."""
    cascade = gw.cascades.get(call.model)
    if cascade is None:
        return
    if call.plan is not None:
        call.version, call.plan, call.role = "", None, None
    if call.version:
        raise BadRequest(
            f"{call.model!r} is a cascade of {[s.model for s in cascade.stages]}: it has no versions; "
            "send the request without one"
        )
    call.cascade = cascade


def _pin(gw: Gateway, model: str) -> str:
    """The version a stage asks for: the stable one of a model in canary (unpinned, Triton would
    answer from its newest loaded version, the candidate), else none (the newest)."""
    return gw.traffic.stable_pin(model, "") if gw.traffic is not None else ""


def _version(gw: Gateway, stage: Stage) -> str:
    return _pin(gw, stage.model) or gw.router.latest_version(stage.model)


def resolved(gw: Gateway, cascade: Cascade) -> str:
    """What a cascade's answer is filed under: its rules, and each stage's model version now."""
    stages = ",".join(
        f"{s.name}={s.model}@{'remote' if s.remote is not None else _version(gw, s)}" for s in cascade.stages
    )
    return f"cascade/{cascade.tag}/{stages}"


async def fetch(gw: Gateway, call: Call, request: Request[A]) -> tuple[A, bytes | None]:
    """The answer and what to store of it (cached.answer's fetch). Stored only when the rule decided
    on every stage it reached (no stage failed), the answering stage is this fleet's (a remote
    gateway's model version is not known here) and answered with the version the key names. An
    offline answer is the leader's alone: identical requests waiting on it ask again (OfflineAnswer),
    so one client's short deadline never hands others the edge's answer."""
    answer = await send(gw, call, request)
    mark, stage = call.mark, call.cascade_stage
    if mark is not None and mark.offline:
        raise OfflineAnswer(answer)
    if mark is None or stage is None or stage.remote is not None or call.cascade_failed:
        return answer, None
    if not request.succeeded(answer):
        return answer, None
    return answer, request.storable(answer, _version(gw, stage))


class OfflineAnswer(RetryableUpstream):
    """Carries an offline answer past the coalescer to its own request (gateway/pipeline/cached.py):
    followers see the leader give up and ask on their own."""

    def __init__(self, answer: object) -> None:
        super().__init__("a cascade answered offline")
        self.answer = answer


async def send(gw: Gateway, call: Call, request: Request[A]) -> A:
    """Stage by stage until one's answer is kept (or the last answers); the answer marked."""
    cascade = call.cascade
    assert cascade is not None
    if request.sequence_id is not None:
        raise BadRequest(
            f"{cascade.name!r} is a cascade: a sequence (sequence_id) must stay on one model's server; "
            "send it to a stage's model by name"
        )
    best: tuple[A, Stage, Route | None] | None = None  # the latest answer a stage gave
    kept = False  # the rule kept it, or the last stage gave it
    score: float | None = None  # the rule's score on the latest answer it judged
    refusal: A | None = None  # Triton refused the request itself (HTTP 4xx): its words, if nothing else
    error: GatewayError | None = None
    metrics = gw.metrics
    for i, stage in enumerate(cascade.stages):
        started = gw.clock()
        sent = None if i == 0 else request.size  # what goes upstream again for each later stage
        try:
            answer, route = await _ask(gw, call, request, stage)
        except GatewayError as exc:
            call.cascade_failed = True
            metrics.cascade_stage(cascade.name, stage.name, gw.clock() - started, False, sent)
            if isinstance(exc, UpstreamRejected) or not isinstance(error, UpstreamRejected):
                error = exc  # the request's own fault outranks a stage being away
            logger.info("cascade %s: stage %s failed, escalating: %s", cascade.name, stage.name, exc.message)
            continue
        succeeded = request.succeeded(answer)
        metrics.cascade_stage(cascade.name, stage.name, gw.clock() - started, succeeded, sent)
        if not succeeded:
            call.cascade_failed = True
            refusal = answer
            continue
        best = (answer, stage, route)
        if stage.rule is None:  # the last stage: its answer stands (offline if a gateway's was)
            remote = request.mark_of(answer) if stage.remote is not None else None
            kept = remote is None or not remote.offline
            break
        probabilities = request.output(answer, stage.rule.output)
        verdict = None if probabilities is None else stage.rule.judge(probabilities)
        if verdict is None:
            metrics.cascade_judged(cascade.name, stage.name, (UNJUDGED,), escalated=True)
            logger.warning(
                "cascade %s: stage %s's answer has no %r output of %d classes to judge; escalating",
                cascade.name,
                stage.name,
                stage.rule.output,
                len(stage.rule.classes),
            )
            continue
        score = verdict.score
        names = stage.rule.classes
        metrics.cascade_judged(
            cascade.name, stage.name, (names[c] for c in verdict.classes), escalated=not verdict.keep
        )
        if verdict.keep:
            kept = True
            break
    if best is None:
        if refusal is not None:
            return refusal
        assert error is not None
        raise error
    answer, stage, route = best
    metrics.cascade_answer(cascade.name, stage.name, offline=not kept)
    call.mark, call.route, call.cascade_stage = (
        Mark(stage.name, score, cascade.tag, offline=not kept),
        route,
        stage,
    )
    try:
        return request.marked(answer, call.mark)
    except ValueError as unreadable:  # an answer that is not the protocol's (a stage behind a broken proxy)
        raise UpstreamError(
            f"cascade {cascade.name}: stage {stage.name}'s answer cannot be read: {unreadable}"
        ) from unreadable


async def _ask(gw: Gateway, call: Call, request: Request[A], stage: Stage) -> tuple[A, Route | None]:
    """One stage's answer within its deadline (and the request's). Always in the identity encoding
    (`shared`): the gateway reads and marks every stage's answer, whatever the client accepts."""
    deadline = call.deadline
    if stage.cfg.deadline_s is not None:
        deadline = min(deadline, gw.clock() + stage.cfg.deadline_s)
    version = "" if stage.remote is not None else _pin(gw, stage.model)
    attempt = request.attempt(version or None, shared=True, model=stage.model, headers=stage.headers)
    if stage.remote is not None:
        left = deadline - gw.clock()
        if left <= 0:
            raise UpstreamTimeout(f"stage {stage.name}: no time left before its deadline")
        return await attempt(stage.remote, left), None
    outcome = await gw.send(stage.model, version, stage.cfg.region or call.pinned, deadline, attempt)
    return outcome.value, outcome.route
