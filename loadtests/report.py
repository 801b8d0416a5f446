"""Read locust's CSV output, draw latency percentiles and throughput over time, check SLOs."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Slo(BaseModel):
    """Bounds a deploy pipeline can gate on; unset bounds are not checked."""

    model_config = ConfigDict(extra="forbid")

    p95_ms: float | None = Field(default=None, gt=0)
    p99_ms: float | None = Field(default=None, gt=0)
    error_rate: float | None = Field(default=None, ge=0, le=1)


def load_slo(path: Path) -> Slo:
    if not path.is_file():
        raise ValueError(f"SLO file {path} does not exist")
    try:
        return Slo(**(yaml.safe_load(path.read_text()) or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(f"SLO file {path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from exc


@dataclass(frozen=True)
class RowStats:
    kind: str
    name: str
    requests: int
    failures: int
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def _f(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


def read_stats(prefix: Path) -> list[RowStats]:
    """Rows of `<prefix>_stats.csv`, the 'Aggregated' row last."""
    path = Path(f"{prefix}_stats.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [
        RowStats(
            r["Type"],
            r["Name"],
            int(r["Request Count"]),
            int(r["Failure Count"]),
            _f(r["Requests/s"]),
            _f(r["50%"]),
            _f(r["95%"]),
            _f(r["99%"]),
        )
        for r in rows
    ]


def check_slo(total: RowStats, slo: Slo) -> list[str]:
    """Human-readable breaches; empty when every bound holds."""
    breaches = []
    if slo.p95_ms is not None and total.p95_ms > slo.p95_ms:
        breaches.append(f"p95 {total.p95_ms:.1f} ms > {slo.p95_ms:g} ms")
    if slo.p99_ms is not None and total.p99_ms > slo.p99_ms:
        breaches.append(f"p99 {total.p99_ms:.1f} ms > {slo.p99_ms:g} ms")
    if slo.error_rate is not None and total.error_rate > slo.error_rate:
        breaches.append(f"error rate {total.error_rate:.4f} > {slo.error_rate:g}")
    if total.requests == 0:
        breaches.append("no requests completed")
    return breaches


def completed_rates(rows: list[dict[str, str]]) -> tuple[list[float], list[float]]:
    """Requests and failures completed per second between history rows (from the running totals).

    Locust's own `Requests/s` column is a rolling average over its last seconds: 0 for the first
    two seconds of a run completing 1,200 requests/s. Differences of the totals are what happened.
    """
    req, fail = [0.0], [0.0]
    for prev, cur in zip(rows, rows[1:], strict=False):
        dt = max(1, int(cur["Timestamp"]) - int(prev["Timestamp"]))
        req.append((_f(cur["Total Request Count"]) - _f(prev["Total Request Count"])) / dt)
        fail.append((_f(cur["Total Failure Count"]) - _f(prev["Total Failure Count"])) / dt)
    return req, fail


def plot_history(prefix: Path, out: Path) -> None:
    """p50/p95/p99 and requests/s over time from `<prefix>_stats_history.csv` (aggregated rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(f"{prefix}_stats_history.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    if not rows:
        raise ValueError(f"{prefix}_stats_history.csv has no aggregated rows; the run recorded nothing")
    t0 = int(rows[0]["Timestamp"])
    t = [int(r["Timestamp"]) - t0 for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for col, label in (("50%", "p50"), ("95%", "p95"), ("99%", "p99")):
        ax1.plot(t, [_f(r[col]) for r in rows], label=label)
    # Locust's running percentiles come from a histogram of whole milliseconds (10 ms steps above
    # 100 ms): the steps in the lines are its resolution, said on the axis rather than smoothed away.
    ax1.set_ylabel("latency (ms, locust's whole-ms buckets)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    completed, failed = completed_rates(rows)
    ax2.plot(t, completed, label="requests/s completed", color="tab:green")
    ax2.plot(t, failed, label="failures/s", color="tab:red")
    ax2.set_ylabel("requests/s")
    users = ax2.twinx()
    users.plot(t, [_f(r["User Count"]) for r in rows], label="users", color="tab:gray", linestyle="--")
    users.set_ylabel("users")
    users.set_ylim(bottom=0)
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper left")
    users.legend(loc="upper right")
    ax2.grid(alpha=0.3)
    fig.suptitle("skewserve load test")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
