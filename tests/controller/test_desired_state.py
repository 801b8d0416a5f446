"""Desired-state transitions and their conditional writes (disk, and S3 through moto elsewhere)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from repository.desired_state import DesiredState
from repository.disk_store import DiskStateStore
from repository.errors import StateConflict, TransitionError


def test_first_version_is_served_later_ones_only_published() -> None:
    s = DesiredState(model="m").published(1).published(2)
    assert s.served == [1] and s.state_of(1) == "promoted" and s.state_of(2) == "published"


def test_canary_promotion_and_rollback_are_state_changes() -> None:
    s = DesiredState(model="m").published(1).published(2).start_canary(2)
    assert s.wanted_on("a") == [1]
    s = s.canary_claimed("me", "a", 30, 100.0).canary_passed("a")
    assert s.wanted_on("a") == [1, 2] and s.wanted_on("b") == [1]
    assert s.canary is not None and s.canary.held_by_other("other", 30, 110.0)
    assert not s.canary.held_by_other("other", 30, 200.0)  # the lease lapses with its holder
    s = s.promote(2)
    assert s.served == [2] and s.state_of(1) == "retired" and s.canary is None
    s = s.rollback()
    assert s.served == [1] and s.state_of(2) == "retired"
    with pytest.raises(TransitionError, match="m version 9 is not published"):
        s.start_canary(9)


def test_a_failed_canary_cannot_be_rolled_back_to() -> None:
    s = DesiredState(model="m").published(1).published(2).start_canary(2).canary_failed("a", "boom")
    assert s.served == [1] and s.state_of(2) == "failed" and s.load_failures == {2: {"a": "boom"}}
    with pytest.raises(TransitionError, match=r"m version 2 failed \(a: boom\); pick another"):
        s.rollback(2)


def test_a_stale_write_is_refused_and_update_retries(tmp_path: Path) -> None:
    store = DiskStateStore(tmp_path)
    (tmp_path / "m").mkdir()
    store.write(DesiredState(model="m").published(1), 0)
    state, token = store.read("m")
    assert state is not None
    store.write(state.published(2), token)
    with pytest.raises(StateConflict):
        store.write(state.published(3), token)  # read before the other write landed
    assert store.update("m", partial(DesiredState.published, version=3)).versions.keys() == {1, 2, 3}


def test_a_never_promoted_version_cannot_be_rolled_back_to() -> None:
    s = DesiredState(model="m").published(1).published(2)
    with pytest.raises(
        TransitionError, match=r"m version 2 was never promoted \(it is published\): roll it out"
    ):
        s.rollback(2)


def test_every_named_region_reports_its_servers_passed_before_promotion() -> None:
    """With one controller per region, each marks its region done; promotion needs them all
    (controller/reconcile.py reads `regions_done` against `canary_regions`)."""
    s = DesiredState(model="m").published(1).published(2).start_canary(2)
    s = s.canary_passed("us-east/a").canary_region_done(["us-east"])
    assert s.canary is not None and s.canary.regions_done == ["us-east"]
    s = s.canary_passed("eu-west/b").canary_region_done(["eu-west"])
    assert s.canary is not None and s.canary.regions_done == ["eu-west", "us-east"]
    assert s.canary_region_done(["us-east"]) is s  # nothing new: no write


def test_a_failed_canarys_version_stays_pinned_away_until_no_server_holds_it() -> None:
    """After a canary fails, gateways keep pinning unversioned requests to the served version for as
    long as some server still has the candidate loaded (Triton would answer from its newest loaded
    version: a client of the rare-class shadow test got the failed version 4 once)."""
    from controller.reconcile import lingering_pins, traffic_plans

    failed = (
        DesiredState(model="m")
        .published(1)
        .published(2)
        .start_canary(2, shadow=0.5)
        .canary_failed("gate", "x")
    )
    states = {"m": failed}
    both = [{"name": "m", "version": "1"}, {"name": "m", "version": "2"}]
    served_only = [{"name": "m", "version": "1"}]
    assert traffic_plans(states.values()) == {}
    assert lingering_pins(states, [served_only, both], {}) == {
        "m": {"stable": 1, "canary": 1, "share": 0.0, "shadow": 0.0, "started": 0.0}
    }
    assert lingering_pins(states, [served_only, served_only], {}) == {}
    in_canary = DesiredState(model="m").published(1).published(2).start_canary(2, shadow=0.5)
    plans = traffic_plans([in_canary])
    assert lingering_pins({"m": in_canary}, [both], plans) == {}  # its canary plan stands
