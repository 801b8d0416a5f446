"""Placement decisions on their own: copies follow demand with hysteresis, capacity always holds,
eviction weighs idle time against reload cost and spares models in use."""

from __future__ import annotations

from controller.placement import CopyBounds, ModelView, PlacementConfig, copies_for, plan_region

CFG = PlacementConfig(server_capacity_bytes=250, target_rps_per_copy=10, hysteresis=0.3, recent_use_guard_s=5)
SERVERS = ["a", "b", "c"]


def _views(rates: dict[str, float], idle: float = 100.0, load_s: float = 1.0) -> dict[str, ModelView]:
    return {m: ModelView(m, 100, r, load_s, {s: idle for s in SERVERS}) for m, r in rates.items()}


def _within_capacity(holds: dict[str, set[str]], views: dict[str, ModelView]) -> bool:
    return all(sum(views[m].footprint for m in ms) <= CFG.server_capacity_bytes for ms in holds.values())


def test_copies_follow_demand_with_hysteresis_and_bounds() -> None:
    b = CopyBounds(min_copies=1, max_copies=3)
    assert copies_for(0, 0, b, CFG, 3) == 1  # the minimum, even idle
    assert copies_for(25, 1, b, CFG, 3) == 3  # 25/s over 10/s per copy
    assert copies_for(12, 1, b, CFG, 3) == 1  # within the band above one copy: stays
    assert copies_for(14, 1, b, CFG, 3) == 2
    assert copies_for(8, 2, b, CFG, 3) == 2  # would fit one copy, but not by the margin (under 7/s)
    assert copies_for(5, 2, b, CFG, 3) == 1
    assert copies_for(0, 3, b, CFG, 3) == 2  # one copy fewer per decision
    assert copies_for(100, 1, CopyBounds(max_copies=2), CFG, 3) == 2


def test_a_hot_model_spreads_and_the_plan_never_exceeds_capacity() -> None:
    views = _views({"hot": 30, "m1": 1, "m2": 1, "m3": 0})
    plan = plan_region(SERVERS, {}, views, {}, CFG)
    assert plan.copies["hot"] == 3 and all("hot" in held for held in plan.holds.values())
    assert _within_capacity(plan.holds, views)
    placed = sorted(m for held in plan.holds.values() for m in held if m != "hot")
    assert placed == ["m1", "m2", "m3"] and plan.unplaced == {}


def test_popularity_shift_evicts_idle_copies_but_not_models_in_use() -> None:
    views = _views({"old": 30, "new": 0, "m2": 0})
    first = plan_region(SERVERS, {}, views, {}, CFG)
    # the shift: "new" is hot, "old" went quiet long ago on two servers but was used just now on "a"
    shifted = {
        "old": ModelView("old", 100, 0, 1.0, {"a": 1.0, "b": 100.0, "c": 100.0}),
        "new": ModelView("new", 100, 30, 1.0, {s: 100.0 for s in SERVERS}),
        "m2": ModelView("m2", 100, 0, 1.0, {s: 100.0 for s in SERVERS}),
    }
    second = plan_region(SERVERS, first.holds, shifted, first.copies, CFG)
    assert _within_capacity(second.holds, shifted)
    assert "old" in second.holds["a"]  # in use there: never evicted
    assert second.copies["old"] == 2 and sum("old" in h for h in second.holds.values()) == 2
    assert sum("new" in h for h in second.holds.values()) == second.copies["new"] == 3


def test_eviction_prefers_idle_cheap_models_and_refuses_when_only_valuable_ones_remain() -> None:
    cfg = PlacementConfig(server_capacity_bytes=200, target_rps_per_copy=10, recent_use_guard_s=5)
    views = {
        "slow_to_load": ModelView("slow_to_load", 100, 0.5, 60.0, {"a": 50.0}),
        "cheap": ModelView("cheap", 100, 0.5, 0.5, {"a": 50.0}),
        "incoming": ModelView("incoming", 100, 5, 1.0, {}),
    }
    plan = plan_region(["a"], {"a": {"slow_to_load", "cheap"}}, views, {"slow_to_load": 1, "cheap": 1}, cfg)
    # a single server: each holds its minimum copy, so nothing may go and "incoming" waits
    assert plan.holds["a"] == {"slow_to_load", "cheap"} and "incoming" in plan.unplaced
    relaxed = cfg.model_copy(update={"default": CopyBounds(min_copies=0)})
    plan = plan_region(
        ["a"], {"a": {"slow_to_load", "cheap"}}, views, {"slow_to_load": 1, "cheap": 1}, relaxed
    )
    assert plan.holds["a"] == {"slow_to_load", "incoming"}  # the cheap reload went


def test_lru_baseline_keeps_one_copy_and_evicts_the_least_recently_used() -> None:
    from controller.placement_lru import plan_region_lru

    views = _views({"hot": 30, "m1": 1, "m2": 1, "m3": 0})
    plan = plan_region_lru(SERVERS, {}, views, {}, CFG)
    assert set(plan.copies.values()) == {1}  # one copy each (the default minimum), whatever the demand
    # full servers: a new model takes the place of the model idle longest, not in recent use
    held = {"a": {"m1", "m2"}, "b": {"hot", "m3"}, "c": {"x", "y"}}
    views = {
        **_views({"hot": 30, "m1": 0, "m2": 0, "m3": 0, "x": 0, "y": 0}),
        "new": ModelView("new", 100, 1.0, 1.0, {}),
    }
    views["m1"] = ModelView("m1", 100, 0, 1.0, {"a": 3.0})  # in recent use: spared
    views["y"] = ModelView("y", 100, 0, 60.0, {"c": 500.0})  # idle longest, however costly to reload
    plan = plan_region_lru(SERVERS, held, views, {}, CFG)
    assert plan.holds["c"] == {"x", "new"} and plan.evictions == ["c: y (least recently used, room for new)"]
    assert _within_capacity(plan.holds, views)
