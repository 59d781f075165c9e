"""server/sse.py's Ticker: items pass through in order, TICK while the source is idle for
an interval (not while items flow), the source's error then its end, and ShuttingDown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from deltaserve.server.sse import TICK, ShuttingDown, Ticker


async def _source(delays: list[float], fail: bool = False) -> AsyncIterator[int]:
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield i
    if fail:
        raise RuntimeError("source failed")


async def _read_all(ticker: Ticker[int]) -> list[object]:
    out: list[object] = []
    while True:
        try:
            out.append(await ticker.next())
        except StopAsyncIteration:
            return out


def test_items_and_ticks() -> None:
    async def main() -> list[object]:
        ticker = Ticker(_source([0, 0, 0.35, 0]), interval=0.1)
        try:
            return await _read_all(ticker)
        finally:
            await ticker.aclose()

    out = asyncio.run(main())
    assert [x for x in out if x is not TICK] == [0, 1, 2, 3]
    assert out[:2] == [0, 1] and out[-2:] == [2, 3]
    assert 2 <= out.count(TICK) <= 4  # ~3 intervals of silence before item 2


def test_no_ticks_while_items_flow() -> None:
    async def main() -> list[object]:
        ticker = Ticker(_source([0.02] * 20), interval=0.1)
        try:
            return await _read_all(ticker)
        finally:
            await ticker.aclose()

    assert asyncio.run(main()) == list(range(20))


def test_error_then_end() -> None:
    async def main() -> None:
        ticker = Ticker(_source([0], fail=True), interval=10)
        assert await ticker.next() == 0
        with pytest.raises(RuntimeError, match="source failed"):
            await ticker.next()
        for _ in range(2):  # the end stays the answer
            with pytest.raises(StopAsyncIteration):
                await ticker.next()
        await ticker.aclose()

    asyncio.run(main())


def test_stop_raises_shutting_down() -> None:
    async def main() -> None:
        stop = asyncio.Event()
        ticker = Ticker(_source([0, 10]), interval=10, stop=stop)
        assert await ticker.next() == 0
        asyncio.get_running_loop().call_later(0.05, stop.set)
        with pytest.raises(ShuttingDown):
            await ticker.next()
        with pytest.raises(ShuttingDown):
            await ticker.next()
        await ticker.aclose()

    asyncio.run(main())
