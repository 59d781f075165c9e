"""The one shape of a generating route; each protocol (chat, completions, messages) is a
thin adapter over it.

    adapter (routes_*.py)                     pipeline (here and in the modules it names)
    parse the body, check the model
    prompt -> token ids                       server/prompts.py (chat-templated protocols)
    sampling fields + OutputSpec  ------>     routes_common.sampling_params, output_constraint
    thinking budget               ------>     thinking_budget
    GenerationRequest(s), a Writer ----->     serve: start_runs -> RunGroup of ChoiceStreams
                                                stream:  writer.head, .event per event, .tail
                                                collect: writer.body(FinishedChoice, ...)

What an adapter adds after submission is a Writer: how its protocol frames the events of
the run (one ChoiceEvent = ordered output pieces of one choice, plus the finish reason on
its last event), its keep-alive, its in-band error and its final object. Everything
else — engine refusals, keep-alives, stop strings, aborts on disconnect, usage, the
request's record and log line once it ends — is here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from fastapi import Request, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from deltaserve.engine.types import (
    GenerationRequest,
    ImageInput,
    InvalidRequestError,
    SamplingParams,
)
from deltaserve.server.errors import APIError
from deltaserve.server.frontend.choice import ChoiceResult, ChoiceStream
from deltaserve.server.frontend.grammar import check_constraint, constraint_for
from deltaserve.server.metrics import RequestTimer
from deltaserve.server.request_log import RequestRecord
from deltaserve.server.routes_common import FieldNames, ServerState, request_error, until_disconnect
from deltaserve.server.routes_generation import ChoiceEvent, RunGroup, TokenCounts, start_runs
from deltaserve.server.schemas import ResponseFormat
from deltaserve.server.sse import EventStreamResponse


@dataclass(frozen=True)
class FinishedChoice:
    """One choice of a finished run, for a non-streaming response."""

    index: int
    result: ChoiceResult
    finish_reason: str  # the pipeline's words: "stop", "length", "tool_calls"


class Writer(Protocol):
    """A protocol's framing of a run (see the module docstring)."""

    keepalive: bytes  # sent while no event has come for the keep-alive interval
    route: str  # the protocol's name in request records: "chat", "completions", ...
    response_id: str  # the response's id, as its client sees it

    def head(self, counts: TokenCounts) -> list[bytes]:
        """Stream events before the first output (counts: the prompt's, known now)."""
        ...

    def event(self, event: ChoiceEvent) -> list[bytes]:
        """Stream events for one choice event."""
        ...

    def tail(self, counts: TokenCounts) -> list[bytes]:
        """Stream events after every choice finished (counts: final)."""
        ...

    def error(self, err: APIError) -> bytes:
        """The in-band error event(s) of a stream that fails after it started."""
        ...

    def body(self, choices: list[FinishedChoice], counts: TokenCounts) -> BaseModel:
        """The non-streaming response object."""
        ...


ToolChoice = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class OutputSpec:
    """What a request asks of the output's shape, in protocol-neutral terms.

    Adapters translate their fields into it (chat: response_format, tool_choice;
    messages: tool_choice any/tool/none). It decides which tools the template sees
    (prompts.template_tools) and is where a constraint would come from (output_constraint).
    """

    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None  # the forced tool when tool_choice is "named"
    parallel_tool_calls: bool = True  # False: only a choice's first call goes out
    response_format: ResponseFormat | None = None


async def output_constraint(
    state: ServerState,
    params: SamplingParams,
    spec: OutputSpec,
    tools: list[dict] | None,
    starts_in_reasoning: bool,
    names: FieldNames,
) -> SamplingParams:
    """The one place a request's OutputSpec becomes an engine constraint: `params` with
    the grammar of `spec.response_format` (json_object / json_schema) or of a forced tool
    call ("required" / "named", over `tools`), starting after `</think>` when the output
    opens in reasoning (server/frontend/grammar.py). The grammar compiles here, in the
    thread pool, so a schema the engine cannot compile is a 400 naming its field."""
    end = state.tokenizer.think_end_id if starts_in_reasoning else None
    try:
        constraint = constraint_for(
            spec.response_format, spec.tool_choice, tools, tool_name=spec.tool_name,
            parallel_tool_calls=spec.parallel_tool_calls, reasoning_end_id=end,
        )  # fmt: skip
        if constraint is None:
            return params
        await run_in_threadpool(check_constraint, state.tokenizer.model_dir, constraint)
        return replace(params, constraint=constraint)
    except InvalidRequestError as exc:
        raise request_error(exc, names) from None


def thinking_budget(
    state: ServerState,
    params: SamplingParams,
    max_thinking_tokens: int | None,
    starts_in_reasoning: bool,
    names: FieldNames,
) -> SamplingParams:
    """`params` with a thinking budget: after `max_thinking_tokens` thinking tokens the
    engine forces "\n</think>\n\n" (the tokenizer's thinking_close_ids) and the model
    answers. Only when the output starts inside thinking; None: unlimited. Call it before
    output_constraint, which checks the two together."""
    if max_thinking_tokens is None or not starts_in_reasoning:
        return params
    close, end = state.tokenizer.thinking_close_ids, state.tokenizer.think_end_id
    try:
        return replace(
            params,
            max_thinking_tokens=max_thinking_tokens,
            thinking_close_ids=close,
            thinking_end_id=end,
        )
    except InvalidRequestError as exc:
        raise request_error(exc, names) from None


def generation_request(
    names: FieldNames,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    n: int = 1,
    prefix_hint: int = 0,
    images: tuple[ImageInput, ...] = (),
) -> GenerationRequest:
    """A GenerationRequest; its own checks fail as a 400 naming the request's field."""
    try:
        return GenerationRequest(request_id, tuple(prompt_ids), params, n, prefix_hint, images)
    except InvalidRequestError as exc:
        raise request_error(exc, names) from None


async def serve(
    request: Request,
    state: ServerState,
    gens: list[GenerationRequest],
    make_choices: Callable[[], list[ChoiceStream]],
    writer: Writer,
    names: FieldNames,
    *,
    stream: bool,
    arrival: float,
) -> Response:
    """Submit `gens` (refusals → 400/429 naming `names`' fields), then stream the run
    through `writer` or collect it into `writer.body`. However the run ends, its engine
    requests are closed and the request's record is logged and kept."""
    timer = state.metrics.timer(arrival)
    group = await start_runs(state, gens, make_choices, timer, names)

    async def finish() -> None:
        await group.close()
        state.requests.add(_record(group, writer, timer))

    if stream:
        return EventStreamResponse(_stream(group, writer), finish, writer.error)
    return await until_disconnect(request, _collect(group, writer, finish))


def _record(group: RunGroup, writer: Writer, timer: RequestTimer) -> RequestRecord:
    counts = group.counts()
    return RequestRecord(
        request_id=writer.response_id,
        route=writer.route,
        num_prompt=counts.num_prompt,
        num_cached=counts.num_cached,
        num_output=counts.num_output,
        ttft_s=timer.ttft_s,
        tokens_per_s=timer.tokens_per_s,
        finish=group.outcome(),
        finished_at=time.time(),
        duration_s=time.monotonic() - timer.start,
    )


async def _stream(group: RunGroup, writer: Writer) -> AsyncIterator[bytes]:
    for chunk in writer.head(group.counts()):
        yield chunk
    async for event in group.events():
        if event is None:
            yield writer.keepalive
            continue
        for chunk in writer.event(event):
            yield chunk
    for chunk in writer.tail(group.counts()):
        yield chunk


async def _collect(
    group: RunGroup, writer: Writer, finish: Callable[[], Awaitable[None]]
) -> Response:
    finish_reasons: dict[int, str] = {}
    try:
        async for event in group.events():
            if event is not None and event.finish_reason is not None:
                finish_reasons[event.index] = event.finish_reason
    finally:
        await finish()
    choices = [
        FinishedChoice(index, choice.result(), finish_reasons[index])
        for index, choice in group.choices()
    ]
    body = writer.body(choices, group.counts())
    return Response(body.model_dump_json(), media_type="application/json")
