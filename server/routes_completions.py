"""POST /v1/completions: raw-text completions, one GenerationRequest per prompt.

A list of prompts runs as concurrent requests; choice `index` is prompt * n + choice, as
OpenAI numbers them. Text is not parsed for reasoning or tool calls. `echo` prepends
the prompt text (without prompt logprobs, so echo + logprobs is refused).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from engine.types import GenerationRequest, SamplingParams
from server.errors import APIError
from server.frontend.choice import ChoiceStream, LogprobEntry
from server.frontend.tokenizer import TextTokenizer
from server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from server.routes_common import (
    ServerState,
    check_model,
    json_body,
    new_id,
    sampling_params,
    server_state,
    until_disconnect,
)
from server.routes_generation import RunGroup, start_runs
from server.schemas import CompletionRequest
from server.sse import DONE, KEEPALIVE, EventStreamResponse, sse_data

router = APIRouter()
# Engine parameter names -> this endpoint's request fields, for 400 messages.
_FIELD_NAMES = {"messages": "prompt", "top_logprobs": "logprobs"}
CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]


@router.post("/v1/completions")
async def create_completion(request: Request, body: CompletionBody) -> Response:
    """OpenAI (legacy) completions, streaming or not."""
    arrival = time.monotonic()
    state = server_state(request)
    check_model(state, body.model)
    prompts = await run_in_threadpool(_prompt_ids, state.tokenizer, body.prompts())
    request_id = new_id("cmpl")
    gens = [
        GenerationRequest(f"{request_id}-{k}", tuple(ids), _params(state, body, ids), n=body.n)
        for k, ids in enumerate(prompts)
    ]

    def choices() -> list[ChoiceStream]:
        stops = body.stop_strings()
        return [
            ChoiceStream(state.tokenizer, stops, parse_tools=False, parse_reasoning=False)
            for _ in range(body.n)
        ]

    group = await start_runs(state, gens, choices, state.metrics.timer(arrival))
    echoes = [state.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    out = _CompletionWriter(request_id, state, body, echoes)
    if body.stream:
        return EventStreamResponse(out.stream(group), group.close)
    return await until_disconnect(request, out.respond(group))


def _prompt_ids(tokenizer: TextTokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    """Tokenize text prompts; check token-id prompts against the vocabulary."""
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max(ids) >= tokenizer.vocab_size:
            raise APIError(400, f"token id {max(ids)} is not in the vocabulary", param="prompt")
        out.append(ids)
    return out


def _params(state: ServerState, body: CompletionRequest, ids: list[int]) -> SamplingParams:
    return sampling_params(
        state,
        body,
        len(ids),
        body.max_tokens,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        field_names=_FIELD_NAMES,
    )


class _CompletionWriter:
    """Builds text_completion objects: stream chunks and the final response."""

    def __init__(
        self, request_id: str, state: ServerState, body: CompletionRequest, echoes: list[str]
    ) -> None:
        self.body = body
        self.head = {
            "id": request_id,
            "created": int(time.time()),
            "model": state.model_name,
            "system_fingerprint": state.fingerprint,
        }
        # Per choice: the echoed prompt, and where its next token's text starts.
        self.echo = [echo for echo in echoes for _ in range(body.n)]
        self.offset = [len(text) for text in self.echo]

    def _object(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(**self.head, choices=choices, usage=usage)

    def _chunk(self, index: int, text: str, reason: str | None = None, **extra: Any) -> bytes:
        choice = CompletionChoice(index=index, text=text, finish_reason=reason, **extra)
        return sse_data(self._object([choice]))

    def _logprobs(self, index: int, entries: Sequence[LogprobEntry]) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self.offset[index])
            self.offset[index] += len(entry.token)
        return CompletionLogprobs(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{top.token: top.logprob for top in e.top} for e in entries],
            text_offset=offsets,
        )

    async def stream(self, group: RunGroup) -> AsyncIterator[bytes]:
        """SSE chunks: echo, text deltas, a last chunk per choice, usage, [DONE]."""
        for index, echo in enumerate(self.echo):
            if echo:
                yield self._chunk(index, echo)
        async for event in group.events():
            if event is None:
                yield KEEPALIVE
                continue
            delta, index = event.delta, event.index
            if delta.content or delta.logprobs:
                logprobs = self._logprobs(index, delta.logprobs)
                yield self._chunk(index, delta.content, logprobs=logprobs)
            if event.finish_reason is not None:
                yield self._chunk(index, "", event.finish_reason)
        if self.body.include_usage:
            yield sse_data(self._object([], group.usage()))
        yield DONE

    async def respond(self, group: RunGroup) -> Response:
        """The whole response, once every choice has finished."""
        reasons: dict[int, str] = {}
        try:
            async for event in group.events():
                if event is not None and event.finish_reason is not None:
                    reasons[event.index] = event.finish_reason
        finally:
            await group.close()
        choices = [
            CompletionChoice(
                index=index,
                text=self.echo[index] + choice.result().content,
                logprobs=self._logprobs(index, choice.result().logprobs),
                finish_reason=reasons[index],
            )
            for index, choice in group.choices()
        ]
        body = self._object(choices, group.usage()).model_dump_json()
        return Response(body, media_type="application/json")
