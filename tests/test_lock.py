"""The running environment is exactly `requirements.lock`, and the lock still satisfies pyproject.toml.

`make setup` installs the lock with `--require-hashes --no-deps`; these tests make any drift (a package
upgraded by hand, a dependency added to pyproject.toml without `make lock`) fail the suite.
`make test-latest` deselects the first one: its venv holds the newest allowed versions on purpose.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
PROJECT = "skewserve"
# A pinned line of pip-compile's output: `name==version \` (hashes follow on indented lines).
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def locked_versions() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = PIN.match(line)
        if match:
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def installed_versions() -> dict[str, str]:
    found = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name != PROJECT:
            found[name] = dist.version
    return found


def test_every_locked_line_is_pinned_and_hashed() -> None:
    text = LOCK.read_text()
    pins = locked_versions()
    # Each requirement line pins one version and is followed by at least one hash.
    blocks = re.findall(
        r"^([A-Za-z0-9][^\n]*?) \\\n((?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text, re.M
    )
    assert {canonicalize_name(b[0].split("==")[0]) for b in blocks} == set(pins)
    assert len(pins) > 50, f"{LOCK} names only {len(pins)} packages"
    assert pins["torch"].endswith("+cpu"), f"torch is locked at {pins['torch']}, not the CPU build"


def test_installed_versions_are_the_locked_ones() -> None:
    locked, installed = locked_versions(), installed_versions()
    missing = {n: v for n, v in locked.items() if n not in installed}
    extra = {n: v for n, v in installed.items() if n not in locked}
    different = {
        n: f"{installed[n]} (locked {v})" for n, v in locked.items() if n in installed and installed[n] != v
    }
    assert not (missing or extra or different), (
        f"this environment is not {LOCK.name}: missing {missing}, not locked {extra}, "
        f"other versions {different}; run `make setup` to install the lock "
        "(or `make lock` first after changing pyproject.toml)"
    )


def test_lock_satisfies_pyproject_and_requirements_in() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"]]
    pending, seen = ["dev"], set()
    while pending:  # `dev` names the project's own extras (skewserve[all]): follow them
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in extras[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == canonicalize_name(project["name"]):
                pending.extend(req.extras)
            else:
                wanted.append(text)
    wanted += [
        line.split("#")[0].strip()
        for line in (ROOT / "requirements.in").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    pins = locked_versions()
    unmet = []
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(Version(version), prereleases=True):
            unmet.append(f"{text} (locked: {version})")
    assert unmet == [], f"{LOCK.name} is stale, run `make lock`: {unmet}"
