"""Stopping a background task for good, even one that swallowed its cancellation.

On Python 3.11, `asyncio.wait_for` returns the inner result when a cancellation lands in the same
loop iteration as that result (CPython gh-86296, fixed in 3.12). A loop that awaits `wait_for`
(dnspython's async resolver does, and so do our own waits) then goes on as if never cancelled, and
`task.cancel(); await task` waits forever: a stop that hangs the gateway's or controller's shutdown.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_AFTER_S = 0.5  # a task that ignored one cancellation gets another after this long


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` until it is done (each retry after a short wait), then collect its outcome so
    an error it raised on the way out is not reported as never retrieved."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_AFTER_S)
    if not task.cancelled():
        task.exception()


async def cancel_all_and_wait(tasks: list[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*(cancel_and_wait(t) for t in tasks))
