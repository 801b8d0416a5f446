"""LRU placement, the baseline of the placement benchmark: what KServe ModelMesh and Ray Serve's
model multiplexing do. A model with requests gets one copy, where there is room, else in place of
the least recently used model (never one used within `recent_use_guard_s`); nothing else moves:
no copies follow demand, and eviction does not weigh the cost of loading a model again."""

from __future__ import annotations

import math

from controller.placement import ModelView, PlacementConfig, Plan


def plan_region_lru(
    servers: list[str],
    held: dict[str, set[str]],
    models: dict[str, ModelView],
    previous: dict[str, int],
    cfg: PlacementConfig,
) -> Plan:
    cap = cfg.server_capacity_bytes
    holds = {s: {m for m in held.get(s, set()) if m in models} for s in servers}
    plan = Plan(holds, {})

    def free(s: str) -> int:
        return cap - sum(models[m].footprint for m in holds[s])

    def idle(m: str, s: str) -> float:
        return models[m].idle_s.get(s, math.inf)

    wanted = [m for m, v in models.items() if v.rate > 0 or cfg.bounds(m).min_copies > 0]
    placed: set[str] = set()  # placed by this plan: not evicted by it
    evicted: set[str] = set()  # evicted by this plan: not placed again by it
    for m in sorted(wanted, key=lambda m: (-models[m].rate, m)):
        if m in evicted or any(m in holds[s] for s in servers):
            continue
        fp = models[m].footprint
        if fp > cap:
            plan.unplaced[m] = f"{m} needs {fp} bytes, more than a server's capacity of {cap}"
            plan.unfit.add(m)
            continue
        fits = [s for s in servers if free(s) >= fp]
        target = max(fits, key=lambda s: (free(s), s)) if fits else None
        while target is None:
            victims = [
                (idle(v, s), s, v)
                for s in servers
                for v in holds[s]
                if idle(v, s) >= cfg.recent_use_guard_s and v not in placed
            ]
            if not victims:
                plan.unplaced[m] = f"{m}: every loaded model was used within {cfg.recent_use_guard_s:g}s"
                break
            _, s, v = max(victims)
            holds[s].discard(v)
            evicted.add(v)
            plan.evictions.append(f"{s}: {v} (least recently used, room for {m})")
            if free(s) >= fp:
                target = s
        if target is not None:
            holds[target].add(m)
            placed.add(m)
    plan.copies = {m: sum(m in holds[s] for s in servers) for m in models}
    return plan
