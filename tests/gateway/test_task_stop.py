"""Background tasks stop even when a cancellation is swallowed (Python 3.11's `wait_for` race).

The local-autoscale test once hung in the stack's stop: discovery's follow loop awaits dnspython's
resolver, which awaits `asyncio.wait_for`; a cancellation that lands as the answer arrives is
swallowed on 3.11, the loop goes on, and `cancel(); await gather(task)` never returns.
"""

from __future__ import annotations

import asyncio

from gateway.task_stop import cancel_all_and_wait, cancel_and_wait


async def _loop_on_wait_for(answers: list[asyncio.Future[None]]) -> None:
    """A follow loop shaped like discovery's: each round awaits an answer through `wait_for`."""
    while True:
        answer = asyncio.get_running_loop().create_future()
        answers.append(answer)
        await asyncio.wait_for(answer, 30)
        await asyncio.sleep(0.01)


async def _cancel_as_answer_arrives(stop) -> bool:  # type: ignore[no-untyped-def]
    answers: list[asyncio.Future[None]] = []
    task = asyncio.get_running_loop().create_task(_loop_on_wait_for(answers))
    await asyncio.sleep(0)  # the loop is now waiting on its first answer
    answers[-1].set_result(None)  # the answer and the cancellation in one loop iteration
    stopping = asyncio.ensure_future(stop(task))
    done, _ = await asyncio.wait({stopping}, timeout=10)
    if not done:  # the old stop: clean up the runaway loop so the test ends either way
        for _ in range(3):
            task.cancel()
            await asyncio.sleep(0.05)
        stopping.cancel()
    return bool(done) and task.done()


def test_a_swallowed_cancellation_still_stops_the_task() -> None:
    assert asyncio.run(_cancel_as_answer_arrives(cancel_and_wait))


def test_every_task_of_a_group_stops() -> None:
    async def stop_group(task: asyncio.Task[None]) -> None:
        idle = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        await cancel_all_and_wait([task, idle])
        assert idle.cancelled()

    assert asyncio.run(_cancel_as_answer_arrives(stop_group))


def test_a_cancelled_task_finishes_its_cleanup_before_any_second_cancel() -> None:
    """The re-cancel is for a task that ignored the first, not one still closing what it holds."""

    async def run() -> list[str]:
        steps: list[str] = []

        async def holds_a_server() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                await asyncio.sleep(0.3)  # closing its connections
                steps.append("closed")

        task = asyncio.get_running_loop().create_task(holds_a_server())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        return steps

    assert asyncio.run(run()) == ["closed"]


def test_a_finished_or_missing_task_is_a_no_op() -> None:
    async def run() -> None:
        await cancel_and_wait(None)
        failed = asyncio.get_running_loop().create_task(asyncio.sleep(0, result=None))
        await failed
        await cancel_and_wait(failed)
        assert not failed.cancelled()

    asyncio.run(run())
