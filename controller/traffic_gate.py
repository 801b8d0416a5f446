"""The traffic gate of a canary with a share or shadow traffic: the gateways' reports, summed, are
judged against the canary's gate (controller/desired_state.py `TrafficGate`).

- share: the canary's error rate may exceed the stable version's by at most `max_error_rate`, and
  its p99 be at most `max_p99_ratio` times the stable version's, once it answered `min_requests`;
- shadow: per class of the stable answer, the share of mirrored requests the shadow answered with
  the same class must reach `agreement` once the class has `min_per_class` judged answers; its
  errors and p99 are held to the same bounds as the share's. Classes still under `min_per_class`
  after `max_wait_s` are named and left unjudged, so a class that never comes cannot hold a
  rollout forever.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from gateway.fleet.traffic_tally import ModelTally, Role, RoleTally, TrafficReport
from repository.desired_state import Canary

Decision = Literal["wait", "pass", "fail"]


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    text: str


MAX_REPORTERS_PER_CALLER = 256  # gateway workers one credential reports for, per canary


class ReportRefused(ValueError):
    """A report the controller does not keep; the message says why."""


class TrafficReports:
    """The latest cumulative report of each gateway worker, per canary (model, version, start).

    Reporters are filed under the caller that sent them (its credential), and only tallies of
    canaries running now are kept: what a caller sends changes only its own share of the sum, and
    memory stays bounded by canaries x callers x MAX_REPORTERS_PER_CALLER."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # written by the API's loop, read by reconcile passes
        self._latest: dict[tuple[str, int, float], dict[str, ModelTally]] = {}

    def add(
        self,
        report: TrafficReport,
        caller: str = "",
        running: dict[str, tuple[int, float]] | None = None,
    ) -> int:
        """Keep the report's tallies of canaries in `running` (model -> (version, started); None:
        all); the number of tallies kept. ReportRefused when the caller has too many reporters."""
        reporter = f"{caller}/{report.reporter}" if caller else report.reporter
        kept = 0
        with self._lock:
            for model, tally in report.models.items():
                if running is not None and running.get(model) != (tally.version, tally.started):
                    continue  # not in canary (ended, or never was): nothing to judge with it
                by_reporter = self._latest.setdefault((model, tally.version, tally.started), {})
                if reporter not in by_reporter and caller:
                    mine = sum(1 for r in by_reporter if r.startswith(f"{caller}/"))
                    if mine >= MAX_REPORTERS_PER_CALLER:
                        raise ReportRefused(
                            f"{caller} already reports for {mine} gateway workers on {model}'s canary "
                            f"(at most {MAX_REPORTERS_PER_CALLER}): keep one reporter name per worker"
                        )
                by_reporter[reporter] = tally
                kept += 1
        return kept

    def total(self, model: str, version: int, started: float) -> ModelTally:
        with self._lock:
            parts = list(self._latest.get((model, version, started), {}).values())
        total = ModelTally(version=version, started=started)
        for part in parts:
            total.add(part)
        return total

    def forget(self, model: str, keep: tuple[int, float] | None) -> None:
        """Drop a model's tallies of canaries that ended (all but `keep`)."""
        with self._lock:
            for key in [k for k in self._latest if k[0] == model and (k[1], k[2]) != keep]:
                del self._latest[key]


def _role_line(name: str, tally: RoleTally) -> str:
    p99 = tally.quantile(0.99)
    p99_text = "-" if p99 is None else f"{p99 * 1000:.1f} ms"
    return f"{name}: {tally.requests} answers, {tally.error_rate:.2%} errors, p99 {p99_text}"


def describe(tally: ModelTally) -> str:
    """The report as lines: roles, then per class (rarest first) mirrored and agreement."""
    lines = [_role_line(r, t) for r, t in tally.roles.items() if t.requests]
    for name, c in sorted(tally.classes.items(), key=lambda kv: (kv[1].seen, kv[0])):
        agreement = c.agreement
        agree = "-" if agreement is None else f"{agreement:.1%}"
        lines.append(
            f"class {name}: {c.seen} stable answers, {c.mirrored} mirrored, agreement {agree}, "
            f"{c.error} shadow errors"
        )
    if tally.skipped:
        lines.append(f"{tally.skipped} requests not mirrored (shadow busy or request too large)")
    return "\n".join(lines)


def _latency_and_errors(candidate: RoleTally, stable: RoleTally, name: str, canary: Canary) -> str | None:
    gate = canary.gate
    if candidate.error_rate > stable.error_rate + gate.max_error_rate:
        return (
            f"{name} error rate {candidate.error_rate:.2%} exceeds the stable version's "
            f"{stable.error_rate:.2%} by more than {gate.max_error_rate:.2%}"
        )
    mine, theirs = candidate.quantile(0.99), stable.quantile(0.99)
    if stable.requests >= gate.min_requests and mine is not None and theirs is not None:
        if mine > gate.max_p99_ratio * theirs:
            return (
                f"{name} p99 {mine * 1000:.1f} ms is above {gate.max_p99_ratio:g}x the stable version's "
                f"{theirs * 1000:.1f} ms"
            )
    return None


def verdict(canary: Canary, tally: ModelTally, now: float) -> Verdict:
    gate = canary.gate
    stable = tally.roles.get("stable", RoleTally())
    waiting: list[str] = []
    candidates: tuple[tuple[Role, float, str], ...] = (
        ("canary", canary.share, "canary"),
        ("shadow", canary.shadow, "mirrored"),
    )
    for role, share, what in candidates:
        candidate = tally.roles.get(role, RoleTally())
        if share <= 0:
            continue
        if candidate.requests < gate.min_requests:
            waiting.append(f"{candidate.requests}/{gate.min_requests} {what} answers")
            continue
        problem = _latency_and_errors(candidate, stable, role, canary)
        if problem is not None:
            return Verdict("fail", problem)
    if canary.shadow > 0:
        short: list[str] = []
        for name, c in sorted(tally.classes.items()):
            judged = c.agree + c.disagree
            if judged < gate.min_per_class:
                short.append(f"class {name} {judged}/{gate.min_per_class}")
                continue
            agreement = c.agreement or 0.0
            if agreement < gate.agreement:
                return Verdict(
                    "fail",
                    f"shadow agrees with the stable version on {agreement:.1%} of class {name} "
                    f"({c.agree} of {judged}), below {gate.agreement:.0%}",
                )
        if not tally.classes:
            waiting.append("no classified answers yet")
        elif short and now - canary.started < gate.max_wait_s:
            waiting.append("mirrored per class: " + ", ".join(short))
        elif short and not waiting:
            return Verdict(
                "pass",
                f"gate passed; left unjudged after {gate.max_wait_s:.0f}s: " + ", ".join(short),
            )
    if waiting:
        return Verdict("wait", "waiting for " + "; ".join(waiting))
    return Verdict("pass", "gate passed")
