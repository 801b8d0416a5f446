"""Helpers for tests that drive the `skewserve` command as a real child process."""

from __future__ import annotations

import subprocess
import sys
import time


def start_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "skewserve.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float = 120.0) -> str:
    """Everything the child printed up to and including the line holding `marker` (or until it exits)."""
    assert proc.stdout is not None
    text = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and marker not in text:
        line = proc.stdout.readline()
        if not line:
            break
        text += line
    return text
