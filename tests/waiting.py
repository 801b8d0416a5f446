"""Waiting on observable state in tests: poll a predicate, bounded, failing with what never happened."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition", interval: float = 0.05
) -> None:
    """Return once `predicate()` is true; AssertionError naming `what` if it never is within `timeout`.

    The bound only keeps a broken run from hanging: no test asserts how long anything took."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
