"""One Prometheus exposition from several worker processes' expositions.

Counters and histograms (and summaries) are sums over workers: every request is counted once,
by the worker that served it; `*_created` keeps the earliest. A gauge is a worker's own view
(a server's availability, its EWMA latency, a region's skew index): summing would invent values,
so each worker's series is kept with a `worker` label. Families keep their first HELP/TYPE and
the order they first appear in.
"""

from __future__ import annotations

import math

_ADDITIVE = frozenset({"counter", "histogram", "summary"})


def _with_worker(key: str, worker: str) -> str:
    label = f'worker="{worker}"'
    if key.endswith("}"):
        name, _, labels = key[:-1].partition("{")
        return f"{name}{{{labels},{label}}}" if labels else f"{name}{{{label}}}"
    return f"{key}{{{label}}}"


def merge_expositions(texts: dict[str, str]) -> str:
    """`texts`: worker name -> its exposition (Prometheus text format 0.0.4)."""
    heads: dict[str, list[str]] = {}  # family -> its HELP/TYPE lines
    kinds: dict[str, str] = {}  # family -> its TYPE
    samples: dict[str, dict[str, float]] = {}  # family -> series key -> value
    for worker, text in texts.items():
        family = ""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head = heads.setdefault(family, [])
                    if len(head) < 2 and line not in head:
                        head.append(line)
                    if parts[1] == "TYPE" and len(parts) == 4:
                        kinds[family] = parts[3].strip()
                    samples.setdefault(family, {})
                continue
            key, _, raw = line.rpartition(" ")
            try:
                value = float(raw)
            except ValueError:
                continue
            series = samples.setdefault(family, {})
            created = key.split("{", 1)[0].endswith("_created") and _counts(family, kinds)
            if kinds.get(family) not in _ADDITIVE and not created:
                series[_with_worker(key, worker)] = value
            elif key not in series:
                series[key] = value
            elif created:
                series[key] = min(series[key], value)
            else:
                series[key] += value
    out: list[str] = []
    for family, series in samples.items():
        out += heads.get(family, [])
        out += [f"{key} {_number(value)}" for key, value in series.items()]
    return "\n".join(out) + "\n"


def _counts(family: str, kinds: dict[str, str]) -> bool:
    """True for a counting family, and for the `<family>_created` gauge family that prometheus_client
    writes beside each one in the 0.0.4 text format (a start time: the earliest wins, no worker label)."""
    if kinds.get(family) in _ADDITIVE:
        return True
    base = family.removesuffix("_created")
    # a counter's TYPE line names `<base>_total` in the 0.0.4 format, a histogram's just `<base>`
    return base != family and (kinds.get(base) in _ADDITIVE or kinds.get(f"{base}_total") in _ADDITIVE)


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if value != int(value) or abs(value) >= 1e16 else f"{int(value)}.0"
