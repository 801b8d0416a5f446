"""Helpers for tests that drive the `skewserve` command as a real child process."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def cli_process(*args: str) -> Iterator[subprocess.Popen[str]]:
    """Run `skewserve ARGS`; however the test ends, Ctrl-C it so it stops the servers it started."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "skewserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


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
