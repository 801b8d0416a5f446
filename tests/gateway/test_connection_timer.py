"""gateway/connection_timer.py on a real event loop: each armed wait expires at its own
deadline (never at a later one pending from an earlier wait), a disarmed wait never expires, and a
busy connection keeps one loop timer rather than one per request."""

from __future__ import annotations

import asyncio

import uvloop

from gateway.connection_timer import NONE, ConnectionTimer

HEADERS, KEEP_ALIVE = 1, 2


def _run(test: object) -> None:
    uvloop.run(test())  # type: ignore[operator]


def test_a_shorter_wait_after_a_longer_one_expires_at_its_own_deadline() -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        expired: asyncio.Future[tuple[int, float]] = loop.create_future()
        timer = ConnectionTimer(loop, lambda wait: expired.set_result((wait, loop.time())))
        timer.arm(KEEP_ALIVE, 3600.0)  # pending an hour out
        armed_at = loop.time()
        timer.arm(HEADERS, 0.05)
        wait, at = await asyncio.wait_for(expired, 60)
        assert wait == HEADERS
        assert at >= armed_at + 0.05
        assert timer.wait == NONE

    _run(test)


def test_a_disarmed_wait_never_expires_and_a_moved_deadline_is_honoured() -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        expired: list[int] = []
        timer = ConnectionTimer(loop, expired.append)
        timer.arm(HEADERS, 0.02)
        timer.disarm(HEADERS)
        timer.disarm(KEEP_ALIVE)  # not the armed wait: no effect either way
        # The pending loop timer fires with nothing armed, and nothing expires.
        first = timer.handle
        assert first is not None
        while timer.handle is first:
            await asyncio.sleep(0.01)
        assert expired == []
        # Armed again while a loop timer is pending for an earlier deadline: the timer re-arms for
        # the rest when it fires early, and the wait expires once, at its own deadline.
        timer.arm(KEEP_ALIVE, 0.01)
        timer.arm(KEEP_ALIVE, 0.2)
        armed_at = loop.time()
        while not expired:
            await asyncio.sleep(0.01)
        assert expired == [KEEP_ALIVE]
        assert loop.time() >= armed_at + 0.2

    _run(test)


def test_a_busy_connection_keeps_one_loop_timer() -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        timer = ConnectionTimer(loop, lambda wait: None)
        timer.arm(HEADERS, 10.0)
        handle = timer.handle
        for _ in range(1000):  # requests: headers in, answer out, next request's headers
            timer.disarm(HEADERS)
            timer.arm(KEEP_ALIVE, 15.0)
            timer.disarm(KEEP_ALIVE)
            timer.arm(HEADERS, 10.0)
        assert timer.handle is handle  # moved deadlines, not new loop timers
        timer.close()
        assert timer.handle is None and timer.wait == NONE

    _run(test)
