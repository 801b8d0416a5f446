"""Run a coroutine in the calling callback until it first waits; a task only if it does.

An infer request whose answer needs nothing from the network (a cache hit, a refusal by admission
or by its own body) is answered from the protocol's callback with no task, no scheduling and no
extra event-loop turn; one that waits (an upstream call) continues in a task from where it waited.
From Python 3.12 this is asyncio's own eager start (the task exists, and is the current task, while
it runs eagerly); on 3.11 it is done here, for this one entry point: the first step runs with no
current task, which nothing on the infer path needs before its first wait (asyncio.wait_for and
asyncio.timeout do from 3.12: hence asyncio's own there). The coroutine runs in its own copy of the
context, then and in its task, as it would in a task from the start (the gateway keeps per-request
state in context variables).
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import sys
from collections.abc import Coroutine, Generator
from typing import Any, Final

_SENT: Final = object()


class _Resumed:
    """`coro`, already started, as the coroutine a task drives: its first step hands the task the
    future `coro` waits on; every later step, a cancellation thrown in before the first one
    included, goes to `coro` where it waits."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def send(self, value: Any) -> Any:
        waiting_on, self.waiting_on = self.waiting_on, _SENT
        if waiting_on is not _SENT:
            return waiting_on  # the task now waits on it (None: a bare yield, stepped again)
        return self.coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self.waiting_on = _SENT
        if val is None and tb is None:
            return self.coro.throw(typ)
        return self.coro.throw(typ, val, tb)  # pragma: no cover (asyncio throws one exception)

    def close(self) -> None:
        self.waiting_on = _SENT
        self.coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        return self  # type: ignore[return-value]

    def __next__(self) -> Any:
        return self.send(None)


# A coroutine to asyncio (its iscoroutine): compiled, the class cannot subclass the ABC (a metaclass
# conflict), so it is registered with it.
collections.abc.Coroutine.register(_Resumed)


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run `coro` now; None when it finished without waiting, else the task that carries it on.
    `coro` handles its own exceptions (an exception escaping its first step propagates here)."""
    context = contextvars.copy_context()
    if sys.version_info >= (3, 12):  # pragma: no cover (the lock's Python is 3.11)
        task: asyncio.Task[None] = asyncio.Task(coro, loop=loop, context=context, eager_start=True)  # type: ignore[call-arg]
        return None if task.done() else task
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_Resumed(coro, waiting_on), context=context)  # type: ignore[arg-type]
