"""One rule for time bounds in the suite: pytest-timeout's ceiling (pyproject.toml) ends a hung test,
and every bound a test sets inside itself (a subprocess or wait timeout, a phase bound) is below it,
so a slow step fails with its own message instead of being cut off mid-way. Bounds keep broken runs
from hanging; no test asserts how long anything took."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# `timeout=600`, `timeout_s=120`, `WAIT_S = 240.0`, `wait_until(..., 90, ...)`, `.wait(30)`
BOUND = re.compile(
    r"(?:\btimeout(?:_s)?\s*=\s*|\b[A-Z_]*WAIT_S\s*=\s*|wait_until\([^,()]*(?:\([^()]*\))?[^,()]*,\s*|\.wait\()"
    r"([0-9][0-9_]*(?:\.[0-9]+)?)\b"
)


def test_every_bound_inside_a_test_is_below_the_suites_ceiling() -> None:
    ceiling = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    over = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in BOUND.finditer(line):
                if float(match.group(1).replace("_", "")) >= ceiling and "client.infer" not in line:
                    over.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not over, f"bounds at or above the {ceiling}s ceiling:\n" + "\n".join(over)


def test_the_pattern_finds_bounds() -> None:
    found = [
        m.group(1)
        for m in BOUND.finditer('run(x, timeout=600); wait_until(lambda: f(a), 90, "y"); p.wait(30)')
    ]
    assert found == ["600", "90", "30"]
