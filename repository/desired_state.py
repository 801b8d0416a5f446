"""One model's desired state: which versions every server serves, and each version's standing.

The record is the single source of truth for what a fleet serves. Publishing adds a version as
`published` and never changes `served`; a canary, a promotion and a rollback are changes of this
record, which the controller then applies to every server it finds (controller/reconcile.py).

Version states: published -> canary -> promoted -> retired, or canary -> failed. `served` holds the
promoted version(s); `canary` the version being checked server by server and the servers it passed.
`load_failures` says, per version, which servers could not load it and why (a promoted version can
fail on one server, e.g. a plan without a build for its GPU, while the rest serve it).
The transitions below are pure: they return a new record, so a conditional write can retry them.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from repository.errors import TransitionError

STATE_FILE = "desired_state.json"
# The record's format. Readers keep fields they do not know (a newer controller's, in another
# region) and write them back unchanged; a record of a newer format is read but never written.
FORMAT = 1
VersionState = Literal["published", "canary", "promoted", "retired", "failed"]


class VersionRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    state: VersionState
    since: float = Field(default_factory=time.time)
    reason: str = ""


class TrafficGate(BaseModel):
    """What live and shadow traffic must show before a canary with a traffic share is promoted
    (controller/traffic_gate.py reads the gateways' reports against it)."""

    model_config = ConfigDict(extra="allow")

    min_requests: int = Field(default=100, ge=1, description="canary (or mirrored) answers before judging")
    min_per_class: int = Field(default=20, ge=1, description="mirrored answers per class before judging it")
    agreement: float = Field(
        default=0.95, ge=0, le=1, description="least share of same-class answers, per class"
    )
    max_error_rate: float = Field(
        default=0.01, ge=0, le=1, description="errors above the stable version's rate"
    )
    max_p99_ratio: float = Field(default=1.5, gt=0, description="candidate p99 over the stable version's")
    max_wait_s: float = Field(
        default=900.0, gt=0, description="after this, classes still under min_per_class are left unjudged"
    )


class Canary(BaseModel):
    model_config = ConfigDict(extra="allow")

    version: int
    # Traffic once servers passed: `share` of clients (sticky per client key) are answered by the
    # canary; `shadow` of requests (stratified by class) are mirrored to it, answers never returned.
    share: float = Field(default=0.0, ge=0, le=1)
    shadow: float = Field(default=0.0, ge=0, le=1)
    gate: TrafficGate = Field(default_factory=TrafficGate)
    report: str = ""  # the gate's latest reading of the gateways' reports, for `skewserve state`
    passed: list[str] = Field(default_factory=list, description="servers whose canary check passed")
    started: float = Field(default_factory=time.time)
    # The controller checking a server now holds a lease: others leave the canary alone until it
    # lapses, so a rollout command and a running controller never check (or undo) the same server.
    owner: str = ""
    checking: str = ""
    heartbeat: float = 0.0
    # regions whose controller found every one of its servers passed (one controller per region)
    regions_done: list[str] = Field(default_factory=list)
    # regions that must all be done before promotion, fixed when the canary starts so that every
    # region's controller holds the same bar (empty: the regions the deciding controller sees)
    regions: list[str] = Field(default_factory=list)

    def held_by_other(self, me: str, lease_s: float, now: float) -> bool:
        return bool(self.owner) and self.owner != me and now - self.heartbeat < lease_s


class DesiredState(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: int = FORMAT
    model: str
    generation: int = 0
    served: list[int] = Field(default_factory=list)
    canary: Canary | None = None
    versions: dict[int, VersionRecord] = Field(default_factory=dict)
    load_failures: dict[int, dict[str, str]] = Field(default_factory=dict)

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes) -> DesiredState:
        return cls.model_validate(json.loads(text))

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    @property
    def newer(self) -> bool:
        """Written by a controller of a newer format: serve from it, never write it."""
        return self.format > FORMAT

    def state_of(self, version: int) -> VersionState | None:
        record = self.versions.get(version)
        return record.state if record else None

    def wanted_on(self, server: str) -> list[int]:
        """Versions `server` should have loaded: the served ones, plus the canary once it passed there
        (a passed server keeps serving the canary until promotion or failure decides)."""
        if self.canary is not None and server in self.canary.passed:
            return sorted({*self.served, self.canary.version})
        return list(self.served)

    # -- transitions -----------------------------------------------------------------------------
    def _next(self, **changes: Any) -> DesiredState:
        data = self.model_copy(deep=True)
        for key, value in changes.items():
            setattr(data, key, value)
        data.generation = self.generation + 1
        return data

    def published(self, version: int) -> DesiredState:
        """A new complete version. The first version of a model is served at once: nothing else
        could serve the model, so there is nothing a canary could compare it with."""
        if version in self.versions:
            return self
        nxt = self._next()
        if not self.served:
            nxt.versions[version] = VersionRecord(state="promoted", reason="first version of the model")
            nxt.served = [version]
        else:
            nxt.versions[version] = VersionRecord(state="published")
        return nxt

    def start_canary(
        self,
        version: int,
        share: float = 0.0,
        shadow: float = 0.0,
        gate: TrafficGate | None = None,
        regions: list[str] | None = None,
    ) -> DesiredState:
        state = self.state_of(version)
        if self.canary is not None and self.canary.version == version:
            return self  # resumed: the servers that passed stay passed
        if self.canary is not None:
            raise TransitionError(
                f"{self.model}: version {self.canary.version} is in canary; wait for it to finish or "
                f"roll it back before rolling out version {version}"
            )
        if state is None:
            raise TransitionError(f"{self.model} version {version} is not published; export it first")
        if version in self.served:
            raise TransitionError(f"{self.model} version {version} is already promoted")
        nxt = self._next(
            canary=Canary(
                version=version,
                share=share,
                shadow=shadow,
                gate=gate or TrafficGate(),
                regions=sorted(regions or []),
            )
        )
        nxt.versions[version] = VersionRecord(state="canary")
        nxt.load_failures.pop(version, None)
        return nxt

    def canary_claimed(self, me: str, server: str, lease_s: float, now: float) -> DesiredState:
        """Take (or renew) the canary lease to check `server`; unchanged if another holds it."""
        if self.canary is None or self.canary.held_by_other(me, lease_s, now):
            return self
        canary = self.canary.model_copy(update={"owner": me, "checking": server, "heartbeat": now})
        return self._next(canary=canary)

    def canary_passed(self, server: str) -> DesiredState:
        assert self.canary is not None
        if server in self.canary.passed:
            return self
        canary = self.canary.model_copy(update={"passed": [*self.canary.passed, server], "checking": ""})
        return self._next(canary=canary)

    def canary_region_done(self, regions: list[str]) -> DesiredState:
        if self.canary is None or set(regions) <= set(self.canary.regions_done):
            return self
        done = sorted({*self.canary.regions_done, *regions})
        return self._next(canary=self.canary.model_copy(update={"regions_done": done}))

    def canary_reported(self, report: str) -> DesiredState:
        if self.canary is None or self.canary.report == report:
            return self
        return self._next(canary=self.canary.model_copy(update={"report": report}))

    @property
    def observed(self) -> bool:
        """Whether the canary waits on traffic (a share or shadow) before promotion."""
        return self.canary is not None and (self.canary.share > 0 or self.canary.shadow > 0)

    def canary_failed(self, server: str, reason: str) -> DesiredState:
        assert self.canary is not None
        version = self.canary.version
        nxt = self._next(canary=None)
        nxt.versions[version] = VersionRecord(state="failed", reason=f"{server}: {reason}")
        nxt.load_failures.setdefault(version, {})[server] = reason
        return nxt

    def promote(self, version: int, reason: str = "") -> DesiredState:
        """`version` becomes the one served; what was served before is retired (kept for rollback)."""
        if self.state_of(version) is None:
            raise TransitionError(f"{self.model} version {version} is not published")
        nxt = self._next(canary=None, served=[version])
        for old in self.served:
            if old != version:
                nxt.versions[old] = VersionRecord(state="retired", reason=f"replaced by version {version}")
        nxt.versions[version] = VersionRecord(state="promoted", reason=reason)
        nxt.load_failures.pop(version, None)
        return nxt

    def rollback(self, to: int | None = None) -> DesiredState:
        """Serve `to` (default: the newest retired version) instead of what is served or in canary."""
        if to is None:
            retired = [v for v, r in self.versions.items() if r.state == "retired"]
            if not retired:
                raise TransitionError(
                    f"{self.model} has no retired version to roll back to; give one with --to"
                )
            to = max(retired)
        state = self.state_of(to)
        if state is None:
            raise TransitionError(f"{self.model} version {to} is not published")
        if state == "failed":
            raise TransitionError(
                f"{self.model} version {to} failed ({self.versions[to].reason}); pick another"
            )
        if state not in ("retired", "promoted"):
            raise TransitionError(
                f"{self.model} version {to} was never promoted (it is {state}): roll it out instead, so its "
                "canary runs on every server"
            )
        nxt = self.promote(to, reason="rolled back to")
        if self.canary is not None and self.canary.version != to:
            nxt.versions[self.canary.version] = VersionRecord(state="retired", reason="rolled back")
        for old in self.served:
            if old != to:
                nxt.versions[old] = VersionRecord(state="retired", reason=f"rolled back to version {to}")
        return nxt

    def load_failed(self, version: int, server: str, reason: str) -> DesiredState:
        if self.load_failures.get(version, {}).get(server) == reason:
            return self
        nxt = self._next()
        nxt.load_failures.setdefault(version, {})[server] = reason
        return nxt

    def load_succeeded(self, versions: list[int], server: str) -> DesiredState:
        if not any(server in self.load_failures.get(v, {}) for v in versions):
            return self
        nxt = self._next()
        for v in versions:
            failures = nxt.load_failures.get(v, {})
            failures.pop(server, None)
            if not failures:
                nxt.load_failures.pop(v, None)
        return nxt

    def removed(self, versions: list[int]) -> DesiredState:
        """Versions deleted from the repository by hygiene: forgotten (they cannot be served again)."""
        gone = [v for v in versions if v in self.versions]
        if not gone:
            return self
        nxt = self._next()
        for v in gone:
            nxt.versions.pop(v, None)
            nxt.load_failures.pop(v, None)
        return nxt


def adopted(model: str, versions: list[int], served: list[int]) -> DesiredState:
    """The record of a model published before desired state existed: it keeps serving what its
    config's version policy served, so adopting it changes nothing on any server."""
    state = DesiredState(model=model, generation=1, served=sorted(served))
    for v in versions:
        state.versions[v] = VersionRecord(
            state="promoted" if v in served else "retired", reason="adopted from the config's version policy"
        )
    return state
