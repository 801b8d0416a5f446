"""Stopping a background task for good, even one that swallowed its cancellation.

On Python 3.11, `asyncio.wait_for` returns the inner result when a cancellation lands in the same
loop iteration as that result (CPython gh-86296, fixed in 3.12). A loop that awaits `wait_for`
(dnspython's async resolver does, and so do our own waits) then goes on as if never cancelled, and
`task.cancel(); await task` waits forever: a stop that hangs the gateway's or controller's shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

# A cancelled task gets this long to run its own cleanup (a `finally` that closes a server, a
# rollback) before it is taken to have swallowed the cancellation and is cancelled again.
CLEANUP_S = 5.0
# Past this the stop gives up on the task (logged, naming it): shutdown must end.
GIVE_UP_S = 30.0


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` and wait until it is done: cancelled again each CLEANUP_S it keeps running,
    given up (with a warning) after GIVE_UP_S. An error it ended with is logged, not raised."""
    if task is None:
        return
    loop = asyncio.get_running_loop()
    give_up = loop.time() + GIVE_UP_S
    name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
    task.cancel()
    while not task.done():
        await asyncio.wait({task}, timeout=min(CLEANUP_S, max(0.0, give_up - loop.time())))
        if task.done():
            break
        if loop.time() >= give_up:
            logger.warning("task %s still running %.0fs after it was cancelled; left behind", name, GIVE_UP_S)
            return
        logger.warning("task %s ignored its cancellation for %.0fs; cancelling it again", name, CLEANUP_S)
        task.cancel()
    if not task.cancelled() and task.exception() is not None:
        logger.warning("task %s ended with an error while stopping: %r", name, task.exception())


async def cancel_all_and_wait(tasks: list[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*(cancel_and_wait(t) for t in tasks))
