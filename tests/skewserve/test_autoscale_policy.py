"""The autoscaling decider (HPA algorithm with stabilisation windows) on an injected clock."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from skewserve.autoscale import (
    AutoscalePolicy,
    ScaleDecider,
    SignalWindow,
    TritonSample,
    parse_triton_metrics,
    recommend,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


POLICY = AutoscalePolicy(target=1000, min_servers=1, max_servers=5, scale_down_window_s=30)


def test_recommend_is_the_hpa_formula_with_tolerance_and_bounds() -> None:
    assert recommend(POLICY, 2, 2000) == 4  # ceil(2 * 2000 / 1000)
    assert recommend(POLICY, 2, 1050) == 2  # within 10 %
    assert recommend(POLICY, 2, 1150) == 3  # ceil(2.3)
    assert recommend(POLICY, 3, 100) == 1  # ceil(0.3)
    assert recommend(POLICY, 3, 0) == 1  # min_servers
    assert recommend(POLICY, 4, 10_000) == 5  # max_servers


def test_scale_up_at_once_scale_down_only_after_the_cool_down() -> None:
    clock = Clock()
    d = ScaleDecider(POLICY, clock)
    assert d.decide(1, 3000) == 3  # up window 0: at once
    clock.now = 5
    assert d.decide(3, 0) == 3  # load gone, but the 3 of t=0 is within the 30 s window
    clock.now = 29
    assert d.decide(3, 0) == 3
    clock.now = 30.5
    assert d.decide(3, 0) == 2  # the last high recommendation left the window: one server at a time
    clock.now = 31
    assert d.decide(2, 0) == 1


def test_a_short_dip_inside_the_cool_down_does_not_remove_servers() -> None:
    clock = Clock()
    d = ScaleDecider(POLICY, clock)
    assert d.decide(2, 1000) == 2
    for t in range(1, 40):
        clock.now = t
        signal = 0 if t % 10 else 1000  # every 10 s one busy observation
        assert d.decide(2, signal) == 2


def test_scale_up_window_needs_a_lasting_signal() -> None:
    clock = Clock()
    d = ScaleDecider(POLICY.model_copy(update={"scale_up_window_s": 10}), clock)
    assert d.decide(1, 1000) == 1
    clock.now = 1
    assert d.decide(1, 4000) == 1  # the recommendation 1 of t=0 is the lowest within 10 s
    clock.now = 10.5
    assert d.decide(1, 4000) == 3  # high for the whole window: 4 recommended, +2 per decision


def test_signal_window_is_a_rate_of_queue_time_per_request_over_servers_present_throughout() -> None:
    w = SignalWindow(AutoscalePolicy(signal="queue_us", target=1000, window_s=5))
    assert w.add(0, {"a": TritonSample(0, 0, 0)}) == 0.0
    assert w.add(1, {"a": TritonSample(5_000, 10, 0)}) == 500.0  # 5 ms queued over 10 requests
    # a new server's counters do not count until it has a sample at the window's start
    assert w.add(2, {"a": TritonSample(10_000, 20, 0), "b": TritonSample(9e9, 1, 0)}) == 500.0
    for t in range(3, 9):
        w.add(t, {"a": TritonSample(10_000, 20, 0), "b": TritonSample(9e9, 1, 0)})
    assert w.add(9, {"a": TritonSample(10_000, 20, 0), "b": TritonSample(9e9, 1, 0)}) == 0.0  # idle


def test_inflight_signal_is_time_inside_servers_per_second_per_server() -> None:
    w = SignalWindow(AutoscalePolicy(signal="inflight", target=4))
    assert w.add(0, {"a": TritonSample(0, 0, 0, 0), "b": TritonSample(0, 0, 0, 0)}) == 0.0
    # over 2 s: a held 6 requests on average (12 s of request time), b held 2 (4 s)
    assert w.add(2, {"a": TritonSample(0, 0, 0, 12e6), "b": TritonSample(0, 0, 0, 4e6)}) == 4.0


def test_parse_triton_metrics_sums_models() -> None:
    text = (
        "# HELP nv_inference_request_success Number of successful inference requests\n"
        "# TYPE nv_inference_request_success counter\n"
        'nv_inference_request_success{model="a",version="1"} 3\n'
        'nv_inference_request_success{model="b",version="1"} 2\n'
        'nv_inference_queue_duration_us{model="a",version="1"} 100\n'
        'nv_inference_pending_request_count{model="a",version="1"} 1\n'
        'nv_inference_queue_duration_us_other{model="a",version="1"} 7\n'
    )
    assert parse_triton_metrics(text + 'nv_inference_request_duration_us{model="b"} 9\n') == TritonSample(
        100, 5, 1, 9
    )


def test_policy_bounds_are_checked() -> None:
    with pytest.raises(ValidationError, match=r"min_servers \(3\) is above max_servers \(2\)"):
        AutoscalePolicy(min_servers=3, max_servers=2)


def test_steps_are_bounded_per_decision() -> None:
    d = ScaleDecider(POLICY, Clock())
    assert d.decide(1, 10_000) == 3  # asks for 5 (max), adds at most 2 per decision
