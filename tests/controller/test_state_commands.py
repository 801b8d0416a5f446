"""`skewserve state` and `skewserve canary` as an operator reads them, run as commands on a real
repository whose desired state moves through publish, canary (with a gate's report) and failure."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

from exporter.pipeline import export_artifact
from repository.desired_state import DesiredState
from repository.disk_store import DiskStateStore


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skewserve", *args], capture_output=True, text=True, timeout=120
    )


def test_state_and_canary_print_the_desired_state(small_artifact: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    store = DiskStateStore(repo)

    shown = _cli("state", "lt", "--repo", str(repo))
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)
    assert state["model"] == "lt" and state["served"] == [1] and state["canary"] is None
    assert {v: r["state"] for v, r in state["versions"].items()} == {"1": "promoted", "2": "published"}
    assert _cli("canary", "lt", "--repo", str(repo)).stdout == (
        "lt: no canary; served: 1; version 1: promoted (adopted from the config's version policy)\n"
    )

    store.update("lt", partial(DesiredState.start_canary, version=2, share=0.25, shadow=0.1))
    store.update("lt", partial(DesiredState.canary_passed, server="us-east-0"))
    store.update(
        "lt", partial(DesiredState.canary_reported, report="class 3: 12 stable answers, agreement 100.0%")
    )
    assert _cli("canary", "lt", "--repo", str(repo)).stdout == (
        "lt: version 2 in canary beside 1; share 25%, shadow 10%; passed on 1 servers\n"
        "class 3: 12 stable answers, agreement 100.0%\n"
    )
    store.update("lt", partial(DesiredState.canary_failed, server="traffic gate", reason="p99 3.1x stable"))
    assert _cli("canary", "lt", "--repo", str(repo)).stdout == (
        "lt: no canary; served: 1; version 2: failed (traffic gate: p99 3.1x stable)\n"
    )
    every = _cli("state", "--repo", str(repo))
    assert every.returncode == 0 and json.loads(every.stdout)["versions"]["2"]["state"] == "failed"

    missing = _cli("canary", "nope", "--repo", str(repo))
    assert missing.returncode == 1 and f"nope is not published in {repo}" in missing.stdout + missing.stderr
