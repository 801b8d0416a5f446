"""The autoscaling policy, shared by the cluster manifests and the local stack.

One signal, one target, one algorithm: the Kubernetes HPA's (which KEDA drives too), so that what
`skewserve up --autoscale` shows on one machine is what deploy/k8s/base/triton-autoscaling.yaml
does in a cluster:

    desired = ceil(current * signal / target)      (unchanged while |signal/target - 1| <= tolerance)
    scale up   to the LOWEST recommendation of the last scale_up_window_s   (0: at once)
    scale down to the HIGHEST recommendation of the last scale_down_window_s (the cool-down)
    at most max_step_up servers more / max_step_down fewer per decision
    clamped to [min_servers, max_servers]

Signals, both read from Triton's own metrics (the Prometheus rules record the same ratios):
- `queue_us`: mean time a request waited in Triton's queue over the window, in microseconds
  (rate(nv_inference_queue_duration_us) / rate(nv_inference_request_success));
- `inflight`: mean requests inside a server (queued or executing) over the window, by Little's law
  from Triton's cumulative request time: rate(nv_inference_request_duration_us) / 1e6 per server.
  Unlike queue time it divides by the number of servers, so it also works where servers share
  CPUs (this machine): adding a server lowers each one's share.

The decider takes its clock as an argument, so its windows are tested without waiting.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AutoscalePolicy(BaseModel):
    """When to add and remove Triton servers (per region)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    signal: Literal["queue_us", "inflight"] = Field(
        default="inflight",
        description="queue_us: mean queue time per request (us); inflight: requests inside each server",
    )
    target: float = Field(
        default=2.0,
        gt=0,
        description="signal value one server should hold (inflight: requests; queue_us: microseconds)",
    )
    min_servers: int = Field(default=1, ge=1, description="never fewer servers per region")
    max_servers: int = Field(default=4, ge=1, description="never more servers per region")
    tolerance: float = Field(
        default=0.1, ge=0, lt=1, description="no change while signal/target is within 1 +- tolerance"
    )
    scale_up_window_s: float = Field(
        default=0.0, ge=0, description="stabilisation before adding: the lowest recent recommendation wins"
    )
    scale_down_window_s: float = Field(
        default=60.0, ge=0, description="cool-down before removing: the highest recent recommendation wins"
    )
    max_step_up: int = Field(default=2, ge=1, description="servers added per decision at most")
    max_step_down: int = Field(
        default=1, ge=1, description="servers removed per decision at most (GPU pods leave one by one)"
    )
    window_s: float = Field(default=5.0, gt=0, description="the signal is a rate over this window")
    interval_s: float = Field(default=1.0, gt=0, description="how often the controller decides")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalePolicy:
        if self.min_servers > self.max_servers:
            raise ValueError(
                f"min_servers ({self.min_servers}) is above max_servers ({self.max_servers}): "
                "lower min_servers or raise max_servers"
            )
        return self


def recommend(policy: AutoscalePolicy, current: int, signal: float) -> int:
    """The HPA formula for one observation, clamped to the policy's bounds."""
    if current < 1:
        return policy.min_servers
    ratio = signal / policy.target
    desired = current if abs(ratio - 1.0) <= policy.tolerance else math.ceil(current * ratio)
    return max(policy.min_servers, min(policy.max_servers, desired))


class ScaleDecider:
    """Stabilised recommendations over time (the HPA's `behavior.*.stabilizationWindowSeconds`)."""

    def __init__(self, policy: AutoscalePolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._history: deque[tuple[float, int]] = deque()

    def decide(self, current: int, signal: float) -> int:
        now = self.clock()
        self._history.append((now, recommend(self.policy, current, signal)))
        keep = max(self.policy.scale_up_window_s, self.policy.scale_down_window_s)
        while self._history and now - self._history[0][0] > keep:
            self._history.popleft()
        up = min(r for t, r in self._history if now - t <= self.policy.scale_up_window_s)
        down = max(r for t, r in self._history if now - t <= self.policy.scale_down_window_s)
        desired = current
        if desired < up:
            desired = up
        if desired > down:
            desired = down
        # The HPA's rate policies (deploy/k8s: 2 pods up, 1 pod down per period), per decision here.
        desired = max(current - self.policy.max_step_down, min(current + self.policy.max_step_up, desired))
        return max(self.policy.min_servers, min(self.policy.max_servers, desired))


@dataclass(frozen=True)
class TritonSample:
    """Totals from one Triton /metrics read, summed over its models."""

    queue_us: float
    success: float
    pending: float
    duration_us: float = 0.0


def parse_triton_metrics(text: str) -> TritonSample:
    """Sum the three series the signals need over every model of one Triton's /metrics text.

    Read line by line on purpose: prometheus_client's parser renames counters to `*_total`.
    """
    names = (
        "nv_inference_queue_duration_us",
        "nv_inference_request_success",
        "nv_inference_pending_request_count",
        "nv_inference_request_duration_us",
    )
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return TritonSample(
        sums["nv_inference_queue_duration_us"],
        sums["nv_inference_request_success"],
        sums["nv_inference_pending_request_count"],
        sums["nv_inference_request_duration_us"],
    )


class SignalWindow:
    """The policy's signal from per-server samples over the last `window_s` (like a PromQL rate)."""

    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self._samples: deque[tuple[float, dict[str, TritonSample]]] = deque()

    def add(self, now: float, samples: dict[str, TritonSample]) -> float:
        self._samples.append((now, samples))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.policy.window_s:
            self._samples.popleft()
        then, oldest = self._samples[0]
        # Only servers present at both ends: a new server's counters start at zero, a removed one's end.
        both = [name for name in samples if name in oldest]
        if self.policy.signal == "inflight":
            busy_us = sum(samples[n].duration_us - oldest[n].duration_us for n in both)
            return busy_us / ((now - then) * 1e6) / len(both) if both and now > then else 0.0
        queued = sum(samples[n].queue_us - oldest[n].queue_us for n in both)
        served = sum(samples[n].success - oldest[n].success for n in both)
        return queued / served if served > 0 else 0.0
