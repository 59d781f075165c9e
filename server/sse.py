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


def _json(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return payload.model_dump_json()
    return json.dumps(payload, separators=(",", ":"))


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

    One pump task per ticker reads the source into a queue, and a read waits on that
    queue: a tick never cancels the source mid-read (a long prefill keeps its pending
    read), and an item costs a queue hand-off, not a task and an asyncio.wait of its own
    (bench/server_overhead.py). Once `stop` is set, reads raise ShuttingDown instead of
    waiting for the source.
    """

    def __init__(
        self, source: AsyncIterator[T], interval: float, stop: asyncio.Event | None = None
    ) -> None:
        self._source = source
        self._interval = interval
        self._stop = stop
        # (what, value): ("item", T), ("end", None), ("error", exc) or ("stop", None)
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._stop_wait: asyncio.Task[None] | None = None  # one per ticker, not per read

    async def _pump_source(self) -> None:
        try:
            async for item in self._source:
                self._queue.put_nowait(("item", item))
        except Exception as exc:  # the reader re-raises it
            self._queue.put_nowait(("error", exc))
        else:
            self._queue.put_nowait(("end", None))

    async def _watch_stop(self) -> None:
        assert self._stop is not None
        await self._stop.wait()
        self._queue.put_nowait(("stop", None))

    async def next(self) -> T | _Tick:
        """The next item, or TICK once the interval passed without one.

        Raises StopAsyncIteration at the end, re-raises the source's errors, and raises
        ShuttingDown once `stop` is set.
        """
        if self._stop is not None and self._stop.is_set():
            raise ShuttingDown
        if self._pump is None:
            self._pump = asyncio.ensure_future(self._pump_source())
            if self._stop is not None:
                self._stop_wait = asyncio.ensure_future(self._watch_stop())
        try:
            what, value = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                async with asyncio.timeout(self._interval):
                    what, value = await self._queue.get()
            except TimeoutError:
                return TICK
        if what == "item":
            return value
        if what == "error":
            raise value
        self._queue.put_nowait((what, value))  # the end (or the stop) stays the answer
        if what == "stop":
            raise ShuttingDown
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop the pump (cancelling a pending read), then close the source (its finally
        blocks run)."""
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
