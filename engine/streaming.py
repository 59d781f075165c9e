"""The asyncio side of an engine client: a request's stream, generate() over a submit
hook, and a step's deltas routed to their streams' event loops. No MLX here: a server
whose engine runs in a process of its own (engine/engine_process.py) imports this and
not the engine, so its own process never loads MLX (on CUDA a process that loads it
holds a device context of its own)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

from deltaserve.engine.types import GenerationRequest, RequestOutput


@dataclass
class Stream:
    """A request's deltas on their way to its caller."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_open: int  # choices the caller has not seen finish yet (asyncio side only)


class StreamingClient:
    """generate() over a submit hook, for the EngineClients that stream through asyncio
    queues: AsyncEngine (the engine thread in this process) and EngineProcess (a child's,
    engine/engine_process.py)."""

    def _submit(self, request: GenerationRequest, stream: Stream) -> Future:
        """Send `request` to the engine; the future answers whether it was accepted (or
        raises as generate would). Raises EngineStoppedError when nothing is taken."""
        raise NotImplementedError

    def _forget(self, request_id: str) -> None:
        """The request was refused, or its caller left before the answer: nothing of it
        may stay on this side."""

    fault: str | None = None  # the device's failure that ended the engine, if one did

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _refusal(self) -> str:
        """Why no request is taken any more (EngineStoppedError's text)."""
        reason = f"the device failed ({self.fault})" if self.fault else "it is shutting down"
        return f"the engine takes no requests: {reason}"

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submit, then yield deltas until every choice finished; closing aborts."""
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue(), request.n)
        accepted = self._submit(request, stream)
        try:
            await asyncio.wrap_future(accepted)  # raises InvalidRequestError / QueueFullError
        except BaseException as exc:
            self._forget(request.request_id)
            if isinstance(exc, asyncio.CancelledError):  # the client left before the answer
                self.abort(request.request_id)  # queued meanwhile, or never: either way
            raise
        try:
            while stream.num_open:
                delta: RequestOutput = await stream.queue.get()
                if delta.finished:
                    stream.num_open -= 1
                yield delta
        finally:
            if stream.num_open:
                self.abort(request.request_id)


def route_deltas(
    deltas: list[RequestOutput], streams: dict[str, Stream], num_open: dict[str, int]
) -> tuple[
    list[RequestOutput], dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]]
]:
    """The deltas of requests in `num_open` (choices not finished yet, by request id), and
    those of them with a stream grouped by its event loop, in order; a request whose last
    choice finished leaves `num_open` and `streams`. Deltas of unknown requests are
    dropped."""
    known = []
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
    for delta in deltas:
        request_id = delta.request_id
        if request_id not in num_open:
            continue
        known.append(delta)
        stream = streams.get(request_id)
        if delta.finished:
            num_open[request_id] -= 1
            if num_open[request_id] == 0:
                del num_open[request_id]
                streams.pop(request_id, None)
        if stream is not None:
            by_loop.setdefault(stream.loop, []).append((stream.queue, delta))
    return known, by_loop


def deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On the streams' event loop: each delta into its stream's queue, in step order."""
    for stream_queue, delta in items:
        stream_queue.put_nowait(delta)


# A delta reaches its client's socket a few rounds of the event loop's ready callbacks
# after `deliver`: the stream's reader wakes (round 1), turns it into a chunk for the
# response's body iterator, which wakes and writes it (round 2); one more for margin
HANDOFF_ROUNDS = 3


def hand_off(
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]],
    wait_s: float,
    rounds: int = HANDOFF_ROUNDS,
) -> bool:
    """Deliver each loop's deltas (as `deliver`), then block the calling thread, at most
    `wait_s` in all, until every loop has run `rounds` more rounds of its ready callbacks,
    in which the streams' tasks those deltas woke write their chunks. Whether every loop
    got there in time; a loop that did not still delivers, later.

    Why: the engine thread and the event loop share one GIL. The thread goes on to build
    its next step in Python, and the loop, woken, gets the GIL only when the thread
    releases it (in MLX's submission and waits) or at the interpreter's switch interval
    (5 ms): the chunks wait out part of the next step's building, a mixed step's longest.
    Waiting here, the loop writes at once, and the engine thread's next step starts that
    much later (on a GPU while the device still computes the step in flight, if one is)."""
    events = []
    for loop, items in by_loop.items():
        done = threading.Event()
        loop.call_soon_threadsafe(_deliver_then_signal, loop, items, done, rounds)
        events.append(done)
    deadline = time.perf_counter() + wait_s
    return all(done.wait(max(deadline - time.perf_counter(), 0.0)) for done in events)


def _deliver_then_signal(
    loop: asyncio.AbstractEventLoop,
    items: list[tuple[asyncio.Queue, RequestOutput]],
    done: threading.Event,
    rounds: int,
) -> None:
    deliver(items)
    _signal_after(loop, done, rounds)


def _signal_after(loop: asyncio.AbstractEventLoop, done: threading.Event, rounds: int) -> None:
    """Set `done` once the loop has run `rounds` more rounds of ready callbacks (each
    call_soon goes behind the callbacks already queued, the woken tasks' steps among
    them)."""
    if rounds:
        loop.call_soon(_signal_after, loop, done, rounds - 1)
    else:
        done.set()
