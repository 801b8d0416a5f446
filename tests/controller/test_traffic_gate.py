"""The traffic gate's verdicts on summed gateway reports (controller/traffic_gate.py)."""

from __future__ import annotations

from controller.traffic_gate import TrafficReports, describe, verdict
from gateway.fleet.traffic_tally import ClassTally, ModelTally, RoleTally, TrafficReport
from repository.desired_state import Canary, TrafficGate

GATE = TrafficGate(
    min_requests=10, min_per_class=5, agreement=0.9, max_error_rate=0.05, max_p99_ratio=2.0, max_wait_s=60
)


def _role(n: int, errors: int = 0, seconds: float = 0.01) -> RoleTally:
    t = RoleTally()
    for i in range(n):
        t.observe(seconds, i >= errors)
    return t


def _tally(**roles: RoleTally) -> ModelTally:
    t = ModelTally(version=2, started=100.0)
    t.roles.update(roles)
    return t


def test_share_waits_then_passes_or_fails_on_errors_and_latency() -> None:
    canary = Canary(version=2, share=0.2, gate=GATE, started=100.0)
    assert verdict(canary, _tally(stable=_role(50), canary=_role(3)), 101).decision == "wait"
    assert verdict(canary, _tally(stable=_role(50), canary=_role(20)), 101).decision == "pass"
    failed = verdict(canary, _tally(stable=_role(50), canary=_role(20, errors=5)), 101)
    assert failed.decision == "fail" and "error rate 25.00%" in failed.text
    slow = verdict(canary, _tally(stable=_role(50), canary=_role(20, seconds=0.1)), 101)
    assert slow.decision == "fail" and "p99" in slow.text


def test_shadow_judges_each_class_and_leaves_short_classes_after_the_wait() -> None:
    canary = Canary(version=2, shadow=0.1, gate=GATE, started=100.0)
    tally = _tally(stable=_role(100), shadow=_role(30))
    tally.classes = {
        "0": ClassTally(seen=90, mirrored=25, agree=25),
        "1": ClassTally(seen=3, mirrored=3, agree=3),
    }
    waiting = verdict(canary, tally, 110)
    assert waiting.decision == "wait" and "class 1 3/5" in waiting.text
    late = verdict(canary, tally, 100 + GATE.max_wait_s + 1)
    assert late.decision == "pass" and "class 1 3/5" in late.text
    tally.classes["1"] = ClassTally(seen=9, mirrored=9, agree=4, disagree=5)
    bad = verdict(canary, tally, 110)
    assert bad.decision == "fail" and "class 1" in bad.text and "44.4%" in bad.text
    assert "class 1: 9 stable answers, 9 mirrored, agreement 44.4%" in describe(tally)


def test_reports_sum_the_latest_of_each_reporter_per_canary() -> None:
    reports = TrafficReports()
    first = _tally(canary=_role(5))
    reports.add(TrafficReport(reporter="a", models={"m": first}))
    reports.add(TrafficReport(reporter="a", models={"m": _tally(canary=_role(7))}))  # cumulative: replaces
    reports.add(TrafficReport(reporter="b", models={"m": _tally(canary=_role(2))}))
    other = ModelTally(version=2, started=200.0)  # a restarted canary counts afresh
    reports.add(TrafficReport(reporter="a", models={"m": other}))
    assert reports.total("m", 2, 100.0).roles["canary"].requests == 9
    assert reports.total("m", 2, 200.0).roles["canary"].requests == 0


def test_a_canary_wrong_on_one_rare_class_fails_though_overall_agreement_is_high() -> None:
    """1000/1000 agreeing head answers and 5/20 on a rare class: 98.5% overall, above the 90% bar,
    and the gate still fails the canary, naming the rare class."""
    canary = Canary(version=2, shadow=0.5, gate=GATE, started=100.0)
    tally = _tally(stable=_role(2040), shadow=_role(1020))
    tally.classes = {
        "head": ClassTally(seen=2000, mirrored=1000, agree=1000),
        "rare": ClassTally(seen=40, mirrored=20, agree=5, disagree=15),
    }
    overall = sum(c.agree for c in tally.classes.values()) / sum(c.mirrored for c in tally.classes.values())
    assert overall > GATE.agreement
    failed = verdict(canary, tally, 110)
    assert (failed.decision, failed.text) == (
        "fail",
        "shadow agrees with the stable version on 25.0% of class rare (5 of 20), below 90%",
    )
