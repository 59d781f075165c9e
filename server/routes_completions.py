"""POST /v1/completions: raw-text completions, one GenerationRequest per prompt.

The OpenAI completions adapter over the generation pipeline (server/pipeline.py). A list
of prompts runs as concurrent requests; choice `index` is prompt * n + choice, as
OpenAI numbers them. Text is not parsed for reasoning or tool calls. `echo` prepends
the prompt text (without prompt logprobs, so echo + logprobs is refused).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from deltaserve.engine.types import SamplingParams
from deltaserve.server.errors import APIError
from deltaserve.server.frontend.choice import ChoiceStream, LogprobEntry
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.pipeline import FinishedChoice, generation_request, serve
from deltaserve.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    openai_usage,
)
from deltaserve.server.routes_common import (
    ServerState,
    check_model,
    json_body,
    new_id,
    sampling_params,
    server_state,
)
from deltaserve.server.routes_generation import ChoiceEvent, TokenCounts
from deltaserve.server.schemas import CompletionRequest
from deltaserve.server.sse import DONE, KEEPALIVE, ChunkFrame, openai_error_event, sse_data

router = APIRouter()
# Engine field names -> this endpoint's request fields, for 400 messages.
# (engine/vision/media.py still says "messages" for the prompt's image-pad tokens.)
_FIELD_NAMES = {"prompt_ids": "prompt", "top_logprobs": "logprobs"}
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
        generation_request(
            _FIELD_NAMES, f"{request_id}-{k}", ids, _params(state, body, ids), n=body.n
        )
        for k, ids in enumerate(prompts)
    ]

    def choices() -> list[ChoiceStream]:
        stops = body.stop_strings()
        return [
            ChoiceStream(state.tokenizer, stops, parse_tools=False, parse_reasoning=False)
            for _ in range(body.n)
        ]

    echoes = [state.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    writer = CompletionWriter(request_id, state, body, echoes)
    return await serve(
        request, state, gens, choices, writer, _FIELD_NAMES, stream=body.stream, arrival=arrival
    )


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
        _FIELD_NAMES,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
    )


class CompletionWriter:
    """text_completion objects, as stream chunks and as the response (pipeline.Writer)."""

    keepalive = KEEPALIVE
    route = "completions"

    def __init__(
        self, request_id: str, state: ServerState, body: CompletionRequest, echoes: list[str]
    ) -> None:
        self.request = body
        self.response_id = request_id
        self.head_fields = {
            "id": request_id,
            "created": int(time.time()),
            "model": state.model_name,
            "system_fingerprint": state.fingerprint,
        }
        # Per choice: the echoed prompt, and where its next token's text starts.
        self.echo = [echo for echo in echoes for _ in range(body.n)]
        self.offset = [len(text) for text in self.echo]
        self._frame = ChunkFrame(self._object([]))

    def _object(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(**self.head_fields, choices=choices, usage=usage)

    def _chunk(
        self,
        index: int,
        text: str,
        reason: str | None = None,
        logprobs: CompletionLogprobs | None = None,
    ) -> bytes:
        """A chunk of one choice, as CompletionChoice serializes (per token: ChunkFrame)."""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return self._frame.data(choice)

    def _logprobs(self, index: int, entries: Sequence[LogprobEntry]) -> CompletionLogprobs | None:
        if self.request.logprobs is None:
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

    def head(self, counts: TokenCounts) -> list[bytes]:
        """The echoed prompts, one chunk per choice that has one."""
        return [self._chunk(index, echo) for index, echo in enumerate(self.echo) if echo]

    def event(self, event: ChoiceEvent) -> list[bytes]:
        """A chunk of new text / logprobs; a last one with the finish reason."""
        out, delta, index = [], event.delta, event.index
        text = delta.content
        if text or delta.logprobs:
            logprobs = self._logprobs(index, delta.logprobs)
            out.append(self._chunk(index, text, logprobs=logprobs))
        if event.finish_reason is not None:
            out.append(self._chunk(index, "", event.finish_reason))
        return out

    def tail(self, counts: TokenCounts) -> list[bytes]:
        """The usage chunk (when asked for), then [DONE]."""
        if not self.request.include_usage:
            return [DONE]
        return [sse_data(self._object([], openai_usage(counts))), DONE]

    def error(self, err: APIError) -> bytes:
        """The error object, then [DONE]."""
        return openai_error_event(err)

    def body(self, choices: list[FinishedChoice], counts: TokenCounts) -> CompletionResponse:
        """The whole response: every choice's text (after its echo) and logprobs."""
        out = [
            CompletionChoice(
                index=choice.index,
                text=self.echo[choice.index] + choice.result.content,
                logprobs=self._logprobs(choice.index, choice.result.logprobs),
                finish_reason=choice.finish_reason,
            )
            for choice in choices
        ]
        return self._object(out, openai_usage(counts))
