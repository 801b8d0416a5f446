"""One Prometheus exposition from several worker processes' expositions.

Every gateway series is a counter, histogram or gauge of in-flight work, so the fleet value is the
sum over workers; `*_created` timestamps keep the earliest. Families keep their first HELP/TYPE
and the order they first appear in.
"""

from __future__ import annotations


def _key_value(line: str) -> tuple[str, float] | None:
    key, _, value = line.rpartition(" ")
    try:
        return key, float(value)
    except ValueError:
        return None


def merge_expositions(texts: list[str]) -> str:
    families: dict[str, list[str]] = {}  # family name -> its HELP/TYPE lines
    samples: dict[str, dict[str, float]] = {}  # family name -> series key -> value
    for text in texts:
        family = ""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head = families.setdefault(family, [])
                    if len(head) < 2 and line not in head:
                        head.append(line)
                    samples.setdefault(family, {})
                continue
            parsed = _key_value(line)
            if parsed is None:
                continue
            key, value = parsed
            series = samples.setdefault(family, {})
            name = key.split("{", 1)[0]
            if key not in series:
                series[key] = value
            elif name.endswith("_created"):
                series[key] = min(series[key], value)
            else:
                series[key] += value
    out: list[str] = []
    for family, series in samples.items():
        out += families.get(family, [])
        out += [f"{key} {_number(value)}" for key, value in series.items()]
    return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return repr(value) if value != int(value) or abs(value) >= 1e16 else f"{int(value)}.0"
