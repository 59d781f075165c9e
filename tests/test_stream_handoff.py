"""engine/streaming.py `hand_off`: a step's deltas go to the streams' event loop, and the
calling (engine) thread waits until the loop has run the tasks they woke, so the chunks
are written before the thread's next step holds the GIL; a loop busy elsewhere costs the
thread at most its wait, and the deltas still arrive."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from deltaserve.engine.streaming import HANDOFF_ROUNDS, hand_off
from deltaserve.engine.types import RequestOutput


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _relay(loop: asyncio.AbstractEventLoop, hops: int) -> tuple[asyncio.Queue, list]:
    """A stream whose delta reaches `written` `hops` wake-ups after its queue: its reader
    task takes it from the queue, then hands it through hops - 1 futures, each awaited by
    the next task (as a server's reader, SSE ticker and response body do)."""
    written: list[RequestOutput] = []

    async def make() -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        futures = [loop.create_future() for _ in range(hops - 1)]

        async def reader() -> None:
            delta = await queue.get()
            (futures[0].set_result(delta) if futures else written.append(delta))

        async def passer(i: int) -> None:
            delta = await futures[i]
            (futures[i + 1].set_result(delta) if i + 1 < len(futures) else written.append(delta))

        loop.create_task(reader())
        for i in range(len(futures)):
            loop.create_task(passer(i))
        await asyncio.sleep(0)  # the tasks wait on their queue and futures now
        return queue

    queue = asyncio.run_coroutine_threadsafe(make(), loop).result(5)
    return queue, written


@pytest.mark.parametrize("hops", [1, 2, HANDOFF_ROUNDS])
def test_the_chunks_are_written_when_the_hand_off_returns(
    loop: asyncio.AbstractEventLoop, hops: int
) -> None:
    queue, written = _relay(loop, hops)
    delta = RequestOutput("r0", 0, (7,))
    assert hand_off({loop: [(queue, delta)]}, wait_s=5.0)
    assert written == [delta]  # no sleep, no poll: written before hand_off returned


def test_a_busy_loop_costs_the_wait_and_loses_nothing(loop: asyncio.AbstractEventLoop) -> None:
    queue, written = _relay(loop, 2)
    release = threading.Event()
    loop.call_soon_threadsafe(release.wait, 10)  # the loop is busy elsewhere
    delta = RequestOutput("r0", 0, (7,))
    assert not hand_off({loop: [(queue, delta)]}, wait_s=0.01)
    assert written == []
    release.set()

    async def rounds(n: int) -> None:  # the loop's next n rounds: the relay's steps run
        for _ in range(n):
            await asyncio.sleep(0)

    asyncio.run_coroutine_threadsafe(rounds(HANDOFF_ROUNDS), loop).result(5)
    assert written == [delta]
