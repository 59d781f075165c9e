"""What handing a step's deltas to the event loop costs the engine thread.

    python -m bench.dispatch_cost [--streams 64] [--steps 400] [--work-ms 4]

On a GPU a step's time is the engine thread's host time (graph building, MLX's
submission), and the HTTP side runs in the same interpreter. Each delta handed over with
its own `loop.call_soon_threadsafe` writes the loop's wake-up socket (a syscall that
releases the GIL) and lets the event loop run its streams' work before the engine thread
gets the GIL back. Here an engine-like thread alternates a fixed amount of pure-Python
work (`--work-ms` of it alone; holding the GIL, as graph building does) with handing
`--streams` deltas to an event loop whose consumers do a streamed chunk's JSON each:
AsyncEngine._dispatch (one call a step) against the per-delta hand-over it replaced, in
turn, the same thread and loop. Prints JSON lines (a step's wall time on the engine
thread, of it the hand-over) and ours / peer.
No model, no MLX work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from types import SimpleNamespace

from deltaserve.engine.async_engine import AsyncEngine, _Counters
from deltaserve.engine.streaming import Stream
from deltaserve.engine.types import RequestOutput


def _busy(iterations: int) -> None:
    """Pure-Python work that holds the GIL, like building a step's graph: a fixed amount
    of it, so that time the event loop takes the GIL for lengthens the step."""
    total = 0
    for i in range(iterations):
        total += i


def _calibrate(seconds: float) -> int:
    """Iterations of `_busy` that take `seconds` on this thread alone."""
    n, spent = 10_000, 0.0
    while spent < 0.05:
        n *= 2
        start = time.perf_counter()
        _busy(n)
        spent = time.perf_counter() - start
    return int(n * seconds / spent)


class _Loop:
    """An event loop on its own thread with one consumer task per stream."""

    def __init__(self, streams: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.queues: list[asyncio.Queue] = []
        self.tasks: list[asyncio.Task] = []
        ready = threading.Event()

        async def consume(q: asyncio.Queue) -> None:
            while True:
                delta = await q.get()
                if delta is None:
                    return
                json.dumps({"choices": [{"delta": {"content": f" w{delta.token_ids[0]}"}}]})

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            for _ in range(streams):
                q: asyncio.Queue = asyncio.Queue()
                self.queues.append(q)
                self.tasks.append(self.loop.create_task(consume(q)))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait()

    def stop(self) -> None:
        """End the consumers, then the loop."""

        async def finish() -> None:
            for q in self.queues:
                q.put_nowait(None)
            await asyncio.gather(*self.tasks)

        asyncio.run_coroutine_threadsafe(finish(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _run(name: str, loop: _Loop, steps: int, work: int) -> dict:
    ids = [f"r{i}" for i in range(len(loop.queues))]
    streams = {rid: Stream(loop.loop, q, 1) for rid, q in zip(ids, loop.queues, strict=True)}
    stub = SimpleNamespace(
        _streams=streams, _open=dict.fromkeys(ids, 1), _counters=_Counters(), _deliver=None
    )
    walls, hands = [], []
    for step in range(steps):
        start = time.perf_counter()
        _busy(work)
        deltas = [RequestOutput(rid, 0, (step,)) for rid in ids]
        handed = time.perf_counter()
        if name == "deltaserve":
            AsyncEngine._dispatch(stub, deltas)  # type: ignore[arg-type]
        else:  # the hand-over _dispatch replaced: one call a delta
            for delta in deltas:
                q = streams[delta.request_id].queue
                loop.loop.call_soon_threadsafe(q.put_nowait, delta)
        end = time.perf_counter()
        walls.append(end - start)
        hands.append(end - handed)
    return {
        "server": name,
        "streams": len(ids),
        "step_ms": round(1e3 * statistics.median(walls), 3),
        "step_p99_ms": round(1e3 * sorted(walls)[int(0.99 * (len(walls) - 1))], 3),
        "handover_ms": round(1e3 * statistics.median(hands), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--work-ms", type=float, default=4.0, help="GIL-held work a step")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each")
    args = ap.parse_args()
    work = _calibrate(args.work_ms / 1e3)
    loop = _Loop(args.streams)
    rows: dict[str, list[dict]] = {"deltaserve": [], "per-delta": []}
    try:
        for _ in range(args.rounds):
            for name in rows:
                row = _run(name, loop, args.steps, work)
                rows[name].append(row)
                print(json.dumps(row), flush=True)
    finally:
        loop.stop()
    ours = statistics.median(r["step_ms"] for r in rows["deltaserve"])
    peer = statistics.median(r["step_ms"] for r in rows["per-delta"])
    print(json.dumps({"step_ms_ours": ours, "step_ms_per_delta": peer, "ratio": ours / peer}))


if __name__ == "__main__":
    main()
