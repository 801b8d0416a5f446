"""One inference request as every pipeline step sees it, whichever front it came in by.

A front fills what its wire says (`Call`) and hands the steps its own form of the request
(`Request`): the steps never read a header or a protobuf field themselves.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from gateway.fleet.dispatch import Attempt, SequenceId

if TYPE_CHECKING:
    import numpy as np

    from gateway.fleet.cascade import Cascade, Mark, Stage
    from gateway.fleet.router import Route
    from gateway.fleet.traffic_plan import Plan
    from gateway.fleet.traffic_tally import Role
    from gateway.state.auth import Principal

A = TypeVar("A")  # a front's answer: HttpResponse, or a serialized ModelInferResponse
# What a call holds while it runs (gateway/pipeline/admission.py): an in-flight slot (a request
# and its answer) or a stream slot (a stream, for as long as it stays open).
Slot = Literal["request", "stream"]


class Call:
    """What the wire said and what the steps decided, for one request or stream: what admission
    took (key, caller, bytes, slot), where it went, how it ended.

    A plain class, not a dataclass: a dataclass's `__init__` is made at import time by exec, so it
    runs interpreted even in the compiled build (a tenth of a cache hit's instructions went there)."""

    __slots__ = (
        "protocol",
        "started",
        "model",
        "version",
        "named",
        "request_id",
        "client",
        "authorization",
        "api_key",
        "pinned",
        "sticky",
        "timeout_ms",
        "call_remaining",
        "passed_on",
        "principal",
        "authenticated",
        "admitted",
        "rate",
        "caller",
        "held",
        "slot",
        "deadline",
        "plan",
        "role",
        "route",
        "cache_state",
        "cascade",
        "mark",
        "cascade_stage",
        "cascade_failed",
        "status",
        "ok",
        "answered",
    )

    def __init__(
        self,
        protocol: str,
        started: float,
        model: str = "",
        version: str = "",
        named: bool = False,
        request_id: str = "",
        client: str = "",
        authorization: str | None = None,
        api_key: str | None = None,
        pinned: str | None = None,
        sticky: str | None = None,
        timeout_ms: str | None = None,
        call_remaining: float | None = None,
        passed_on: bool = False,
        status: str = "500",
    ) -> None:
        self.protocol = protocol  # "http" | "grpc": the metrics label
        self.started = started
        self.model = model
        self.version = version
        self.named = named  # the model is known (from the path, or once the message is read); "" is a name
        self.request_id = request_id  # the id the gateway logs and forwards (x-request-id)
        self.client = client  # the peer's address
        self.authorization = authorization
        self.api_key = api_key
        self.pinned = pinned  # the client's region pin (routing.region_header)
        self.sticky = sticky  # traffic.sticky_header: whose canary bucket
        self.timeout_ms = timeout_ms  # retries.timeout_header
        self.call_remaining = call_remaining  # a gRPC call's own deadline, seconds left
        self.passed_on = passed_on  # a header the answer may depend on is forwarded: never cached
        # set by the steps
        self.principal: Principal | None = None
        self.authenticated = False
        self.admitted = False
        self.rate: asyncio.Future[None] | None = None  # a rate check already under way (the gRPC bridge's)
        self.caller = ""  # whom the request's bytes are counted against
        self.held = 0  # bytes counted in gw.bodies, given back when the call ends
        self.slot: Slot | None = None  # held in gw.inflight or gw.streams until admission.release
        self.deadline = 0.0
        self.plan: Plan | None = None
        self.role: Role | None = None
        self.route: Route | None = None
        self.cache_state: str | None = None  # "hit" | "miss" | "coalesced" when the cache was asked
        self.cascade: Cascade | None = None  # the model is a cascade's served name (pipeline/cascade.py)
        self.mark: Mark | None = None  # what the cascade's answer says: its stage, the rule's score
        self.cascade_stage: Stage | None = None  # the stage whose answer it is
        self.cascade_failed = False  # a stage failed or refused on the way: not what the rule alone chose
        self.status = status  # the metrics label: HTTP status or gRPC code name
        self.ok = False  # not the server's fault (what a canary is judged on)
        self.answered = False  # the answer is on the wire: a later error cannot change it


class Request(Protocol, Generic[A]):
    """A front's parsed request: what the cache, dispatch and shadow steps need from it."""

    size: int  # bytes held
    sequence_id: SequenceId  # stateful models: every request of a sequence on one server
    timeout_us: int | None  # the request's own `timeout` parameter
    request_id: str  # the id inside the request (JSON `id`, protobuf `id`): a shared answer gets it

    def check(self) -> None:
        """The gateway's limits on what the request holds (batch size...): BadRequest when over."""

    def cacheable(self) -> bool:
        """Whether an answer to this request may be shared (no sequence, nothing read from headers)."""

    async def cache_key(self, resolved: str, tenant: str) -> str: ...

    def attempt(
        self,
        version: str | None = None,
        shared: bool = False,
        model: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> Attempt[A]:
        """Send this request to one server (as another `version` of the model when given; `shared`:
        for an answer every client may get, so in the identity encoding; to another `model` when
        given, a cascade's stage; with `headers` added, a stage behind another gateway's key)."""

    def storable(self, answer: A, resolved: str | None) -> bytes | None:
        """The bytes to store for `answer`, or None when it must not be stored (`resolved`: the
        version it must have been answered by; None when no version is checked)."""

    def succeeded(self, answer: A) -> bool:
        """Whether `answer` is an inference result (not Triton's refusal)."""

    def output(self, answer: A, name: str) -> np.ndarray[Any, Any] | None:
        """The output `name` of a successful answer, one row per item; None when it holds none."""

    def marked(self, answer: A, mark: Mark) -> A:
        """`answer` carrying a cascade's mark in its parameters (and, over HTTP, its headers)."""

    def mark_of(self, answer: A) -> Mark | None:
        """The cascade mark a stored answer carries (a cache hit), or None."""

    def classes(self, answer: A, output: str) -> list[str] | None:
        """The class of each row of `answer` (shadow traffic), None when it cannot be read."""

    def decode(self, stored: bytes) -> A: ...

    def restamp(self, answer: A) -> A:
        """A shared answer (cached, coalesced) with this request's own id."""
