"""Run a coroutine in the calling callback until it first waits; a task only if it does.

An infer request whose answer needs nothing from the network (a cache hit, a refusal by admission
or by its own body) is answered from the protocol's callback with no task, no scheduling and no
extra event-loop turn; one that waits (an upstream call) continues in a task from where it waited.
Python 3.12's eager task factory does this for every task; on 3.11 it is done here, for this one
entry point. The coroutine runs in its own copy of the context, then and in its task, as it would
in a task from the start (the gateway keeps per-request state in context variables).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any


class _Continue:
    """Awaiting this resumes `coro` where it first waited: the task waits on what it yielded."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, None, None]:
        coro, signal = self.coro, self.waiting_on
        self.waiting_on = None
        while True:
            try:
                yield signal  # the future (or None: a bare yield) the coroutine is waiting on
            except BaseException as exc:  # the task's cancellation, thrown where the coroutine waits
                try:
                    signal = coro.throw(exc)
                except StopIteration:
                    return
                continue
            try:
                signal = coro.send(None)
            except StopIteration:
                return


async def _rest(coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    await _Continue(coro, waiting_on)


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run `coro` now; None when it finished without waiting, else the task that carries it on.
    `coro` handles its own exceptions (an exception escaping its first step propagates here)."""
    context = contextvars.copy_context()
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_rest(coro, waiting_on), context=context)
