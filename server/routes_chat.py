"""POST /v1/chat/completions: validate → render the prompt → submit → stream or collect.

Images: user messages' image_url parts are fetched, decoded and preprocessed in the same
worker-thread hop as the template (server/images.py); each becomes its image-pad tokens in
the prompt and an ImageInput in GenerationRequest.images.

Tools: tool_choice "none" hides the tools from the template (and output is not parsed
for calls); "required" and a named function send the tools (only the named one for the
latter). Generation is NOT grammar-constrained: the template asks for a call, but if the
model answers in prose we return what it produced. parallel_tool_calls=false keeps only
the first call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from engine.types import GenerationRequest, ImageInput
from server.frontend.choice import ChoiceResult, ChoiceStream, LogprobEntry, ToolCallChunk
from server.frontend.messages import PromptError, image_refs
from server.frontend.tokenizer import TextTokenizer
from server.images import load_images, processor_config
from server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    FunctionCall,
    FunctionCallDelta,
    TokenLogprobOut,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from server.routes_common import (
    check_model,
    json_body,
    new_id,
    sampling_params,
    server_state,
    until_disconnect,
)
from server.routes_generation import GenerationRun, start_run
from server.schemas import ChatCompletionRequest, NamedToolChoice
from server.settings import ImageSettings
from server.sse import DONE, KEEPALIVE, EventStreamResponse, sse_data

router = APIRouter()
_FIELD_NAMES_NEW = {"max_tokens": "max_completion_tokens"}  # when the client used the new name
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, body: ChatBody) -> Response:
    """OpenAI chat completions, streaming (SSE) or not; n > 1 shares one prefill."""
    arrival = time.monotonic()
    state = server_state(request)
    check_model(state, body.model)
    tools = template_tools(body)
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    # Images, templates and tokenizers are CPU work: keep them off the event loop.
    prompt = await run_in_threadpool(
        _render, state.tokenizer, state.settings.images, messages, tools, body.chat_template_kwargs
    )
    state.metrics.images.inc(len(prompt.images))
    params = sampling_params(
        state,
        body,
        len(prompt.ids),
        body.max_new_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        field_names=_FIELD_NAMES_NEW if body.max_completion_tokens is not None else None,
    )
    gen = GenerationRequest(
        new_id("chatcmpl"),
        tuple(prompt.ids),
        params,
        n=body.n,
        prefix_hint=prompt.history,
        images=prompt.images,
    )
    reasoning = prompt.starts_in_reasoning
    choices = [
        ChoiceStream(state.tokenizer, body.stop_strings(), tools, reasoning, tools is not None)
        for _ in range(gen.n)
    ]
    run = await start_run(state, gen, choices, state.metrics.timer(arrival))
    head = ChunkHead(gen.request_id, int(time.time()), state.model_name, state.fingerprint)
    if body.stream:
        return EventStreamResponse(_stream(run, body, head), run.close)
    return await until_disconnect(request, _respond(run, body, head))


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]
    starts_in_reasoning: bool  # the prompt ends inside an opened <think>
    history: int  # the prefix hint: tokens of the messages without the generation prompt
    images: tuple[ImageInput, ...]


def _render(
    tokenizer: TextTokenizer,
    settings: ImageSettings,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
) -> RenderedPrompt:
    """Load the messages' images, then render and tokenize the prompt around them."""
    refs = image_refs(messages)
    if refs and tokenizer.image_pad_id is None:
        raise PromptError("this model does not take images", refs[0].param)
    images = load_images(refs, settings, processor_config(tokenizer.model_dir)) if refs else ()
    tokens = [image.num_tokens for image in images] if refs else None  # None: text only
    ids, starts_in_reasoning = tokenizer.render_chat(messages, tools, kwargs, tokens)
    history = tokenizer.history_length(ids, messages, tools, kwargs, tokens)
    return RenderedPrompt(ids, starts_in_reasoning, history, images)


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template gets, per tool_choice (see the module docstring)."""
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if isinstance(body.tool_choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == body.tool_choice.function.name]
    return tools


@dataclass(frozen=True)
class ChunkHead:
    """The fields every chunk of one response repeats."""

    id: str
    created: int
    model: str
    fingerprint: str

    def chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        """One SSE event carrying a chat.completion.chunk."""
        return sse_data(
            ChatCompletionChunk(
                id=self.id,
                created=self.created,
                model=self.model,
                system_fingerprint=self.fingerprint,
                choices=choices,
                usage=usage,
            )
        )


async def _stream(
    run: GenerationRun, body: ChatCompletionRequest, head: ChunkHead
) -> AsyncIterator[bytes]:
    for index in range(run.request.n):
        yield head.chunk(
            [ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))]
        )
    async for event in run.events():
        if event is None:
            yield KEEPALIVE
            continue
        delta = event.delta
        calls = _call_deltas(delta.tool_calls, body.parallel_tool_calls)
        if delta.content or delta.reasoning or calls or delta.logprobs:
            out = ChatDelta(
                content=delta.content or None,
                reasoning_content=delta.reasoning or None,
                tool_calls=calls or None,
            )
            logprobs = chat_logprobs(delta.logprobs) if body.logprobs else None
            yield head.chunk([ChatChunkChoice(index=event.index, delta=out, logprobs=logprobs)])
        if event.finish_reason is not None:
            last = ChatChunkChoice(
                index=event.index, delta=ChatDelta(), finish_reason=event.finish_reason
            )
            yield head.chunk([last])
    if body.include_usage:
        yield head.chunk([], usage=run.usage())
    yield DONE


async def _respond(run: GenerationRun, body: ChatCompletionRequest, head: ChunkHead) -> Response:
    finish_reasons: dict[int, str] = {}
    try:
        async for event in run.events():
            if event is not None and event.finish_reason is not None:
                finish_reasons[event.index] = event.finish_reason
    finally:
        await run.close()
    choices = [
        _choice(index, choice.result(), finish_reasons[index], body)
        for index, choice in enumerate(run.choices)
    ]
    response = ChatCompletionResponse(
        id=head.id,
        created=head.created,
        model=head.model,
        system_fingerprint=head.fingerprint,
        choices=choices,
        usage=run.usage(),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _choice(
    index: int, result: ChoiceResult, reason: str, body: ChatCompletionRequest
) -> ChatChoice:
    calls = [
        ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in result.tool_calls
    ]
    if not body.parallel_tool_calls:
        calls = calls[:1]
    message = ChatMessageOut(
        content=result.content if result.content or not calls else None,
        tool_calls=calls or None,
        reasoning_content=result.reasoning or None,
    )
    logprobs = chat_logprobs(result.logprobs) if body.logprobs else None
    return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason)


def _call_deltas(chunks: Sequence[ToolCallChunk], parallel: bool) -> list[ToolCallDelta]:
    out = []
    for chunk in chunks:
        if not parallel and chunk.index > 0:
            continue  # parallel_tool_calls=false: only the first call goes out
        out.append(
            ToolCallDelta(
                index=chunk.index,
                id=chunk.id,
                type="function" if chunk.id is not None else None,
                function=FunctionCallDelta(name=chunk.name, arguments=chunk.arguments),
            )
        )
    return out


def chat_logprobs(entries: Sequence[LogprobEntry]) -> ChoiceLogprobs:
    """Frontend logprob entries in the chat shape (token, logprob, bytes, top_logprobs)."""
    return ChoiceLogprobs(
        content=[
            TokenLogprobOut(
                token=entry.token,
                logprob=entry.logprob,
                bytes=list(entry.token_bytes),
                top_logprobs=[
                    TopLogprob(token=top.token, logprob=top.logprob, bytes=list(top.token_bytes))
                    for top in entry.top
                ],
            )
            for entry in entries
        ]
    )
