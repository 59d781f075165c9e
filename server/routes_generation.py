"""Generation as the routes see it: a GenerationRun submits one GenerationRequest and
turns its RequestOutputs into per-choice events (text deltas through the frontend's
ChoiceStream, finish reasons); a RunGroup reads several runs as one (a list of prompts).

Engine contract used here (engine/api.py): `generate()` submits and streams; submission
errors (InvalidRequestError, QueueFullError) surface on the first read at the latest.
`start_run` therefore waits up to one keep-alive interval for that first read before a
route commits to a status code, so those errors become a 400 / 429 (naming the request's
field, through the protocol's FieldNames), not an SSE event.
Stop strings are the frontend's: when every choice has hit one, the run aborts the
engine request (a choice cannot be aborted alone, so with n > 1 the others run on).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from deltaserve.engine.types import GenerationRequest, InvalidRequestError, RequestOutput
from deltaserve.server.errors import APIError, as_api_error
from deltaserve.server.frontend.choice import ChoiceDelta, ChoiceStream
from deltaserve.server.metrics import RequestTimer
from deltaserve.server.request_log import CLIENT_GONE
from deltaserve.server.routes_common import FieldNames, ServerState, request_error
from deltaserve.server.sse import TICK, Ticker


@dataclass(frozen=True)
class ChoiceEvent:
    """New output of one choice: its frontend delta, and on its last event the reason.

    finish_reason is the pipeline's protocol-neutral vocabulary (OpenAI's words): "stop",
    "length", "tool_calls"; each protocol's writer translates it.
    """

    index: int  # choice index in the response
    delta: ChoiceDelta
    finish_reason: str | None = None
    stop_string: str | None = None  # on the last event: the stop string that ended it


@dataclass(frozen=True)
class TokenCounts:
    """A response's token counts, for each protocol's usage object."""

    num_prompt: int
    num_output: int
    num_cached: int  # prompt tokens the engine restored from its prefix cache


class GenerationRun:
    """One submitted GenerationRequest, read as ChoiceEvents (None = keep-alive tick)."""

    def __init__(
        self,
        state: ServerState,
        request: GenerationRequest,
        choices: list[ChoiceStream],
        timer: RequestTimer,
        index_offset: int = 0,
    ) -> None:
        self.state = state
        self.request = request
        self.choices = choices
        self.index_offset = index_offset  # completions: prompt k's choices start at k * n
        self._timer = timer
        self._ticker = Ticker(
            state.engine.generate(request), state.settings.server.keepalive, state.stopping
        )
        self._is_open = [True] * request.n  # choices whose end the caller has not seen
        self.finish_reasons: list[str | None] = [None] * request.n  # as each choice ends
        self.failure: str | None = None  # why events() failed, once it has
        self._num_output = [0] * request.n
        self._num_cached = 0  # prompt tokens the engine restored from its prefix cache
        self._engine_done = [False] * request.n
        self._first: RequestOutput | None = None  # read by start(), replayed by events()
        self._is_accepted = False  # the engine took it (no refusal on the first read)
        self._abort_sent = False
        self._closed = False

    async def start(self) -> None:
        """Wait up to one keep-alive interval for the engine to accept (or refuse)."""
        first = await self._ticker.next()
        self._first = None if first is TICK else first  # type: ignore[assignment]
        if self._first is not None:  # so a stream's first event can report it
            self._num_cached = self._first.num_cached_tokens
        self._is_accepted = True

    async def events(self) -> AsyncIterator[ChoiceEvent | None]:
        """Yield choice events until every choice finished; None when idle a while.

        A failure (engine error, shutdown) is kept in `failure` for the request's record,
        then raised."""
        pending, self._first = self._first, None
        try:
            while any(self._is_open):
                if pending is not None:
                    output, pending = pending, None
                else:
                    try:
                        output = await self._ticker.next()
                    except StopAsyncIteration:
                        raise APIError(500, "the engine ended the request early") from None
                    if output is TICK:
                        yield None
                        continue
                event = self._on_output(output)  # type: ignore[arg-type]
                if event is not None:
                    yield event
        except Exception as exc:
            self.failure = as_api_error(exc).message
            raise
        await self.close()

    def _on_output(self, out: RequestOutput) -> ChoiceEvent | None:
        i = out.index
        self._num_output[i] = max(self._num_output[i], out.num_output_tokens)
        self._num_cached = max(self._num_cached, out.num_cached_tokens)
        self._engine_done[i] = out.finished
        if not self._is_open[i]:
            return None  # already ended by a stop string; the engine is catching up
        self._timer.on_tokens(self.index_offset + i, len(out.token_ids))
        if out.finish_reason == "error":
            raise APIError(500, f"generation failed: {out.error or 'engine error'}")
        if out.finish_reason == "abort":
            raise APIError(503, "the request was aborted by the server (shutting down?)")
        choice = self.choices[i]
        delta = choice.push(out)
        if not (out.finished or delta.stop_hit):
            return ChoiceEvent(self.index_offset + i, delta)
        delta = delta.then(choice.finish())
        self._is_open[i] = False
        if not any(self._is_open):
            self._abort()  # stop strings ended every choice before the engine did
        reason = choice.finish_reason(out.finish_reason)
        self.finish_reasons[i] = reason
        return ChoiceEvent(self.index_offset + i, delta, reason, choice.stop_string)

    def _abort(self) -> None:
        # Only once, and only for a request the engine took and has not finished.
        if self._is_accepted and not self._abort_sent and not all(self._engine_done):
            self._abort_sent = True
            self.state.engine.abort(self.request.request_id)

    def counts(self) -> TokenCounts:
        """Token counts so far (final once events() has ended)."""
        return TokenCounts(len(self.request.prompt_ids), sum(self._num_output), self._num_cached)

    async def close(self) -> None:
        """Abort the engine request if it still runs, and record token counts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._abort()
        await self._ticker.aclose()
        if self._is_accepted:
            metrics = self.state.metrics
            metrics.prompt_tokens.inc(len(self.request.prompt_ids))
            metrics.generated_tokens.inc(sum(self._num_output))


async def start_run(
    state: ServerState,
    request: GenerationRequest,
    choices: list[ChoiceStream],
    timer: RequestTimer,
    names: FieldNames,
    index_offset: int = 0,
) -> GenerationRun:
    """Submit `request`; raises the engine's refusal (→ 400/429) if it comes in time."""
    if not state.engine.stats().is_alive:
        # A dead engine thread would never answer: fail now instead of hanging.
        raise APIError(503, "the engine is not running", code="engine_unavailable")
    run = GenerationRun(state, request, choices, timer, index_offset)
    try:
        await run.start()
    except InvalidRequestError as exc:
        await run.close()
        raise request_error(exc, names) from None
    except BaseException:
        await run.close()
        raise
    return run


class RunGroup:
    """Several runs read as one event stream; their choice indexes are disjoint."""

    def __init__(self, runs: list[GenerationRun]) -> None:
        self.runs = runs

    def choices(self) -> Iterator[tuple[int, ChoiceStream]]:
        """(response index, choice stream) of every choice, in index order."""
        for run in self.runs:
            for k, choice in enumerate(run.choices):
                yield run.index_offset + k, choice

    def events(self) -> AsyncIterator[ChoiceEvent | None]:
        """Every run's events as they come; a failure in one ends the group.

        One run's events are its own (no generator in between: a layer costs per token)."""
        if len(self.runs) == 1:
            return self.runs[0].events()
        return self._merged_events()

    async def _merged_events(self) -> AsyncIterator[ChoiceEvent | None]:
        queue: asyncio.Queue[ChoiceEvent | None | Exception | _End] = asyncio.Queue()

        async def pump(run: GenerationRun) -> None:
            try:
                async for event in run.events():
                    queue.put_nowait(event)
                queue.put_nowait(_END)
            except Exception as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.ensure_future(pump(run)) for run in self.runs]
        try:
            num_running = len(tasks)
            while num_running:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, _End):
                    num_running -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    def outcome(self) -> str:
        """How the group ended, for its record: the failure, CLIENT_GONE when choices
        were still open (the reader stopped early), or the choices' finish reasons."""
        failures = [run.failure for run in self.runs if run.failure is not None]
        if failures:
            return f"error: {failures[0]}"
        reasons = [reason for run in self.runs for reason in run.finish_reasons]
        if None in reasons:
            return CLIENT_GONE
        return ",".join(dict.fromkeys(reasons))  # type: ignore[arg-type]

    def counts(self) -> TokenCounts:
        """Token counts summed over the runs."""
        counts = [run.counts() for run in self.runs]
        return TokenCounts(
            sum(c.num_prompt for c in counts),
            sum(c.num_output for c in counts),
            sum(c.num_cached for c in counts),
        )

    async def close(self) -> None:
        """Close every run (aborting what still runs)."""
        for run in self.runs:
            await run.close()


class _End:
    """Queue marker: one run of a group has finished."""


_END = _End()


async def start_runs(
    state: ServerState,
    requests: list[GenerationRequest],
    make_choices: Callable[[], list[ChoiceStream]],
    timer: RequestTimer,
    names: FieldNames,
) -> RunGroup:
    """Submit all `requests` at once; if one is refused, close the others and raise."""
    num_choices = requests[0].n
    started = await asyncio.gather(
        *(
            start_run(state, request, make_choices(), timer, names, k * num_choices)
            for k, request in enumerate(requests)
        ),
        return_exceptions=True,
    )
    group = RunGroup([run for run in started if isinstance(run, GenerationRun)])
    failures = [error for error in started if isinstance(error, BaseException)]
    if failures:
        await group.close()
        raise failures[0]
    return group
