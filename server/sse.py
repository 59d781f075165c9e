"""Server-sent events: framing, keep-alive ticks, and the error-safe stream wrapper.

Framing (what OpenAI clients parse):

    data: {json}\\n\\n        one chunk
    : keep-alive\\n\\n        a comment, sent while no token has come for `keepalive` s
    data: {"error": {...}}\\n\\n   a failure after the stream started (then [DONE])
    data: [DONE]\\n\\n        the end

Anthropic streams name each event (`event: message_start\ndata: {...}\n\n`), send
`event: ping` as their keep-alive and `event: error` on failure, with no [DONE]: a stream's
writer (server/pipeline.py) says which framing it uses; `sse_event` writes named events.

Server shutdown is such a failure: a Ticker given the server's `stop` event raises
ShuttingDown (a 503) at once, so open streams end with an error event (and [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
import pydantic_core
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from deltaserve.server.errors import APIError, as_api_error

T = TypeVar("T")

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


class _Tick:
    """Sentinel: the interval passed without an item."""

    def __repr__(self) -> str:
        return "TICK"


TICK = _Tick()


class ShuttingDown(APIError):
    """The server began shutting down while this request was generating."""

    def __init__(self) -> None:
        message = "the server is shutting down; retry the request"
        super().__init__(503, message, code="server_shutting_down")


def sse_data(payload: BaseModel | dict[str, Any]) -> bytes:
    """One `data:` event with a compact JSON payload."""
    return f"data: {_json(payload)}\n\n".encode()


def sse_event(name: str, payload: BaseModel | dict[str, Any]) -> bytes:
    """One named event (`event: <name>`) with a compact JSON payload."""
    return f"event: {name}\ndata: {_json(payload)}\n\n".encode()


# What json.dumps(payload, separators=(",", ":")) builds per call, built once.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


def _json(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return payload.model_dump_json()
    return _COMPACT_JSON.encode(payload)


class ChunkFrame:
    """`data:` events of one stream's chunk objects, built around their `choices`.

    A chunk object (chat.completion.chunk, text_completion) repeats the same id, created,
    model and fingerprint in every chunk; only `choices` changes. The constant part is
    serialized once per stream (by the pydantic model itself, from `envelope`: the chunk
    with no choices and no usage, so `choices` is its last field), and each chunk costs
    one pydantic_core.to_json of its choice: plain dicts and lists, with pydantic models
    only where their own serializer matters (e.g. logprobs, whose -inf is null). Building
    and validating the pydantic chunk models per token cost several times more
    (bench/README.md, bench.server_overhead); to_json writes strings and numbers exactly
    as model_dump_json does, and tests/test_server_chunks.py checks the bytes against it.
    """

    def __init__(self, envelope: BaseModel) -> None:
        text = envelope.model_dump_json()
        if not text.endswith('"choices":[]}'):
            raise ValueError(f"`choices` is not the last field of {type(envelope).__name__}")
        self._head = f"data: {text[:-2]}".encode()  # ... "choices":[
        self._tail = b"]}\n\n"

    def data(self, choice: dict[str, Any]) -> bytes:
        """The event of a chunk whose only choice is `choice` (the model's field order)."""
        return b"".join((self._head, pydantic_core.to_json(choice), self._tail))


def openai_error_event(err: APIError) -> bytes:
    """A failure after an OpenAI stream started: the error object, then [DONE]."""
    return sse_data(err.body()) + DONE


class Ticker(Generic[T]):
    """Reads an async iterator, returning TICK whenever `interval` s pass without an item.

    One pump task per ticker reads the source into a deque, and the (one) reader waits on
    a future that the next entry resolves: a tick never cancels the source mid-read (a
    long prefill keeps its pending read), and an item costs a deque hand-off, not a task
    and an asyncio.wait of its own. Ticks come from one timer per ticker, re-armed once
    per interval, which puts TICK when no item came for a whole interval; a timeout
    around each read would schedule and cancel a timer per item (bench.server_overhead,
    bench/README.md). Once `stop` is set, reads raise ShuttingDown instead of waiting.
    """

    def __init__(
        self, source: AsyncIterator[T], interval: float, stop: asyncio.Event | None = None
    ) -> None:
        self._source = source
        self._interval = interval
        self._stop = stop
        # (what, value): ("item", T), ("tick", None), ("error", exc), ("end", None) or
        # ("stop", None); an error is followed by the end.
        self._entries: deque[tuple[str, Any]] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader's, while it waits
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: asyncio.Task[None] | None = None
        self._stop_wait: asyncio.Task[None] | None = None  # one per ticker, not per read
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0  # loop time of the latest item (or tick)

    def _put(self, what: str, value: Any) -> None:
        self._entries.append((what, value))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _pump_source(self) -> None:
        assert self._loop is not None
        try:
            async for item in self._source:
                self._last = self._loop.time()
                self._put("item", item)
        except Exception as exc:  # the reader re-raises it
            self._put("error", exc)
        self._put("end", None)
        self._cancel_timer()  # the end is the answer from now on: no more ticks

    async def _watch_stop(self) -> None:
        assert self._stop is not None
        await self._stop.wait()
        self._put("stop", None)

    def _on_timer(self) -> None:
        """TICK if no item came for an interval (and the reader has nothing else); re-arm
        one interval after the latest item or tick."""
        assert self._loop is not None
        now = self._loop.time()
        due = self._last + self._interval
        if now >= due:
            if not self._entries:
                self._put("tick", None)
            self._last, due = now, now + self._interval
        self._timer = self._loop.call_at(due, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def next(self) -> T | _Tick:
        """The next item, or TICK once the interval passed without one.

        Raises StopAsyncIteration at the end, re-raises the source's errors, and raises
        ShuttingDown once `stop` is set.
        """
        if self._stop is not None and self._stop.is_set():
            raise ShuttingDown
        if self._loop is None:
            self._start()
        entries = self._entries
        while not entries:
            assert self._loop is not None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        what, value = entries.popleft()
        if what == "item":
            return value
        if what == "tick":
            return TICK
        if what == "error":
            raise value
        entries.appendleft((what, value))  # the end (or the stop) stays the answer
        if what == "stop":
            raise ShuttingDown
        raise StopAsyncIteration

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pump = asyncio.ensure_future(self._pump_source())
        if self._stop is not None:
            self._stop_wait = asyncio.ensure_future(self._watch_stop())
        self._last = self._loop.time()
        self._timer = self._loop.call_at(self._last + self._interval, self._on_timer)

    async def aclose(self) -> None:
        """Stop the pump (cancelling a pending read) and the ticks, then close the source
        (its finally blocks run)."""
        self._cancel_timer()
        if self._stop_wait is not None:
            self._stop_wait.cancel()
            self._stop_wait = None
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(BaseException):
                await self._pump
            self._pump = None
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def guarded(
    chunks: AsyncIterator[bytes], on_error: Callable[[APIError], bytes] = openai_error_event
) -> AsyncIterator[bytes]:
    """Pass `chunks` through; turn a failure into the protocol's error event(s)."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # the status line is gone: report the failure in-band
        yield on_error(as_api_error(exc))


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends.

    Also when the client disconnects before the body generator even started (Starlette
    then cancels the send loop and the generator's own finally would never run), so the
    engine request is always aborted.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        on_error: Callable[[APIError], bytes] = openai_error_event,
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        body = guarded(chunks, on_error)
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: after a disconnect the scope is cancelled, and every await in it
            # would raise again before the engine request is aborted.
            with anyio.CancelScope(shield=True):
                await self._on_close()
