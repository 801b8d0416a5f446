"""Placement by demand: which models each server of a region holds, within its capacity in bytes.

Copies of a model follow its measured demand in the region (requests per second per copy as the
target) within the model's minimum and maximum, with hysteresis: a model gains copies only once its
rate passes the current copies' share by `hysteresis`, and loses one only once the rate fits in one
copy fewer by the same margin, so placement does not thrash around a threshold.

Copies are added hot models first, on the server with the most free bytes. When nothing has room,
a server makes room by evicting models in order of idle time over the cost of loading them again
(a model idle for long and cheap to reload goes first; not plain LRU), and never a model used within
`recent_use_guard_s` (its requests may still be in flight), a copy its model's minimum needs, or one
worth more per byte than the model placed, unless gateways hold requests for that model now and the
idle one needs no more than one copy (a cold model's waiting requests are served once such a model
can make room; copies that hot models need are never given up for them). A model whose rate fell
below `idle_rate` keeps its last copy until another model needs the room. A model that still does not fit stays unplaced, with
the reason. The plan never puts a server over its capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


class CopyBounds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_copies: int = Field(default=1, ge=0)
    max_copies: int | None = Field(default=None, ge=1)


class PlacementConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    server_capacity_bytes: int = Field(gt=0, description="model memory each server may hold")
    policy: Literal["demand", "lru"] = Field(
        default="demand",
        description="demand: copies follow demand, eviction weighs idle time against reload cost; "
        "lru: one copy per requested model, least recently used evicted (the benchmark's baseline)",
    )
    target_rps_per_copy: float = Field(default=20.0, gt=0, description="requests per second one copy serves")
    hysteresis: float = Field(default=0.3, ge=0, lt=1)
    default: CopyBounds = CopyBounds()
    models: dict[str, CopyBounds] = Field(default_factory=dict, description="bounds per model")
    recent_use_guard_s: float = Field(
        default=30.0, ge=0, description="a model used this recently on a server is never evicted there"
    )
    idle_rate: float = Field(
        default=0.01,
        ge=0,
        description="requests per second below which a model needs no copy beyond its minimum; its last "
        "copy stays until another model needs the room, and a request loads it again",
    )
    footprint_overhead: float = Field(
        default=1.5,
        ge=1.0,
        description="memory per byte of model files, when Triton reports no memory_usage for the model",
    )

    def bounds(self, model: str) -> CopyBounds:
        return self.models.get(model, self.default)


@dataclass(frozen=True)
class ModelView:
    """What placement knows of a model in one region."""

    name: str
    footprint: int  # bytes one copy takes
    rate: float  # requests per second in the region (smoothed)
    load_s: float = 1.0  # how long a load took (the cost of evicting it)
    idle_s: dict[str, float] = field(default_factory=dict)  # per server holding it: since last use
    asked: bool = False  # a gateway holds requests for it now (a cold start): they need a copy


@dataclass
class Plan:
    holds: dict[str, set[str]]
    copies: dict[str, int]
    unplaced: dict[str, str] = field(default_factory=dict)
    evictions: list[str] = field(default_factory=list)
    unfit: set[str] = field(default_factory=set)  # larger than any server: unplaced whatever happens


class PlacementPolicy(Protocol):
    """A policy plans one region: which servers hold which models, from the same view for every policy.

    `held` is what each server holds now, `previous` the copies the last plan wanted; a policy never
    places a model on a server beyond `cfg.server_capacity_bytes`."""

    def __call__(
        self,
        servers: list[str],
        held: dict[str, set[str]],
        models: dict[str, ModelView],
        previous: dict[str, int],
        cfg: PlacementConfig,
    ) -> Plan: ...


def copies_for(rate: float, previous: int, bounds: CopyBounds, cfg: PlacementConfig, servers: int) -> int:
    lo = min(bounds.min_copies, servers)
    hi = min(bounds.max_copies or servers, servers)
    wanted = math.ceil(rate / cfg.target_rps_per_copy) if rate >= cfg.idle_rate and rate > 0 else 0
    if previous > 0:
        up = rate > previous * cfg.target_rps_per_copy * (1 + cfg.hysteresis)
        down = rate < (previous - 1) * cfg.target_rps_per_copy * (1 - cfg.hysteresis)
        if not up and not down:
            wanted = previous
        elif down:
            wanted = max(wanted, previous - 1)  # one copy at a time
    return max(lo, min(hi, wanted))


def plan_region(
    servers: list[str],
    held: dict[str, set[str]],
    models: dict[str, ModelView],
    previous: dict[str, int],
    cfg: PlacementConfig,
) -> Plan:
    cap = cfg.server_capacity_bytes
    copies = {
        m: copies_for(v.rate, previous.get(m, 0), cfg.bounds(m), cfg, len(servers)) for m, v in models.items()
    }
    for m, v in models.items():
        if v.asked and copies[m] == 0 and cfg.bounds(m).max_copies != 0:
            copies[m] = 1  # requests wait for it now
    holds = {s: {m for m in held.get(s, set()) if m in models} for s in servers}
    plan = Plan(holds, copies)

    def used(s: str) -> int:
        return sum(models[m].footprint for m in holds[s])

    def count(m: str) -> int:
        return sum(1 for s in servers if m in holds[s])

    fresh: set[tuple[str, str]] = set()  # (model, server) placed by this plan: never its victims

    def idle(m: str, s: str) -> float:
        return -1.0 if (m, s) in fresh else models[m].idle_s.get(s, math.inf)

    def evictable(m: str, s: str) -> bool:
        return idle(m, s) >= cfg.recent_use_guard_s

    # Surplus copies go, the longest idle first (never one in recent use: it waits for the next pass);
    # a model's last copy stays until another model needs its room.
    for m in models:
        surplus = min(count(m) - copies[m], count(m) - 1)
        for s in sorted((s for s in servers if m in holds[s]), key=lambda s: -idle(m, s)):
            if surplus <= 0:
                break
            if evictable(m, s):
                holds[s].discard(m)
                plan.evictions.append(f"{s}: {m} (demand {models[m].rate:.1f}/s needs {copies[m]} copies)")
                surplus -= 1
    # A server already over capacity (a footprint learned after its load) sheds its least valuable.
    for s in servers:
        for m in sorted(holds[s], key=lambda m: -idle(m, s) / max(models[m].load_s, 0.1)):
            if used(s) <= cap:
                break
            if evictable(m, s):
                holds[s].discard(m)
                plan.evictions.append(f"{s}: {m} (server over capacity)")

    def value(m: str) -> float:
        return models[m].rate / max(models[m].footprint, 1)

    for m in sorted(models, key=lambda m: (-models[m].rate, m)):
        need = copies[m] - count(m)
        fp = models[m].footprint
        if need > 0 and fp > cap:
            plan.unplaced[m] = f"{m} needs {fp} bytes, more than a server's capacity of {cap}"
            plan.unfit.add(m)
            continue
        while need > 0:
            candidates = [s for s in servers if m not in holds[s]]
            if not candidates:
                break
            fits = [s for s in candidates if cap - used(s) >= fp]
            if fits:
                target = max(fits, key=lambda s: (cap - used(s), s))
            else:
                target = _make_room(m, candidates, holds, models, copies, cfg, used, count, value, idle, plan)
                if target is None:
                    plan.unplaced[m] = (
                        f"{m} needs {copies[m]} copies of {fp} bytes; {count(m)} placed: no server has room "
                        "without evicting a model in use or worth more"
                    )
                    break
            holds[target].add(m)
            fresh.add((m, target))
            need -= 1
    return plan


def _make_room(m, candidates, holds, models, copies, cfg, used, count, value, idle, plan):  # type: ignore[no-untyped-def]
    cap = cfg.server_capacity_bytes
    fp = models[m].footprint
    for s in sorted(candidates, key=lambda s: -(cap - used(s))):
        victims = sorted(
            (
                v
                for v in holds[s]
                if idle(v, s) >= cfg.recent_use_guard_s
                # a model with requests waiting may take the room of an idle one that one copy serves
                and (
                    value(v) * (1 + cfg.hysteresis) < value(m)
                    or (models[m].asked and models[v].rate < cfg.target_rps_per_copy)
                )
                and count(v) - 1 >= min(cfg.bounds(v).min_copies, copies[v])
            ),
            key=lambda v: -idle(v, s) / max(models[v].load_s, 0.1),
        )
        freed, chosen = cap - used(s), []
        for v in victims:
            if freed >= fp:
                break
            chosen.append(v)
            freed += models[v].footprint
        if freed >= fp:
            for v in chosen:
                holds[s].discard(v)
                plan.evictions.append(f"{s}: {v} (room for {m})")
            return s
    return None
