"""POST /v1/chat/completions: the OpenAI chat adapter over the generation pipeline.

The route validates, renders the prompt (server/prompts.py: images, template), builds the
sampling parameters and hands a ChatWriter to pipeline.serve; the writer frames choice
events as chat.completion.chunk objects and the finished choices as a chat.completion.

Tools: tool_choice "none" hides the tools from the template (and output is not parsed
for calls); "required" and a named function send the tools (only the named one for the
latter), and the output is grammar-constrained to tool calls of those tools
(pipeline.output_constraint; one call when parallel_tool_calls is false).
response_format json_object / json_schema constrains the content the same way (with
callable tools under "auto": the document or tool calls); reasoning stays free.
Thinking budget: max_thinking_tokens (our extension), else reasoning_effort's budget
(schemas.effort_thinking_tokens); past it the engine closes `</think>` and the model answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from deltaserve.server.errors import APIError
from deltaserve.server.frontend.choice import ChoiceStream, LogprobEntry, ToolCallChunk
from deltaserve.server.pipeline import (
    FinishedChoice,
    OutputSpec,
    generation_request,
    output_constraint,
    serve,
    thinking_budget,
)
from deltaserve.server.prompts import render_prompt, template_tools
from deltaserve.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    FunctionCall,
    TokenLogprobOut,
    ToolCall,
    TopLogprob,
    Usage,
    openai_usage,
)
from deltaserve.server.routes_common import (
    check_model,
    json_body,
    new_id,
    sampling_params,
    server_state,
)
from deltaserve.server.routes_generation import ChoiceEvent, TokenCounts
from deltaserve.server.schemas import ChatCompletionRequest, NamedToolChoice
from deltaserve.server.sse import DONE, KEEPALIVE, ChunkFrame, openai_error_event, sse_data

router = APIRouter()
# Engine field names -> this endpoint's request fields, for 400 messages.
_FIELD_NAMES = {"prompt_ids": "messages", "images": "messages"}
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, body: ChatBody) -> Response:
    """OpenAI chat completions, streaming (SSE) or not; n > 1 shares one prefill."""
    arrival = time.monotonic()
    state = server_state(request)
    check_model(state, body.model)
    spec = output_spec(body)
    all_tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    tools = template_tools(all_tools, spec)
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    prompt = await render_prompt(state, messages, tools, body.template_kwargs())
    state.metrics.images.inc(len(prompt.images))
    names = _field_names(body)
    params = sampling_params(
        state,
        body,
        len(prompt.ids),
        body.max_new_tokens,
        names,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
    )
    reasoning = prompt.starts_in_reasoning
    budget = body.thinking_tokens(params.max_tokens)
    params = thinking_budget(state, params, budget, reasoning, names)
    params = await output_constraint(state, params, spec, tools, reasoning, names)
    gen = generation_request(
        names,
        new_id("chatcmpl"),
        prompt.ids,
        params,
        n=body.n,
        prefix_hint=prompt.history,
        images=prompt.images,
    )

    def choices() -> list[ChoiceStream]:
        reasoning, stops = prompt.starts_in_reasoning, body.stop_strings()
        parse_tools = tools is not None
        return [
            ChoiceStream(state.tokenizer, stops, tools, reasoning, parse_tools)
            for _ in range(gen.n)
        ]

    writer = ChatWriter(gen.request_id, state.model_name, state.fingerprint, body)
    return await serve(
        request, state, [gen], choices, writer, names, stream=body.stream, arrival=arrival
    )


def _field_names(body: ChatCompletionRequest) -> dict[str, str]:
    if body.max_completion_tokens is not None:  # the client used the new name
        return {**_FIELD_NAMES, "max_tokens": "max_completion_tokens"}
    return _FIELD_NAMES


def output_spec(body: ChatCompletionRequest) -> OutputSpec:
    """The request's tool_choice and response_format in the pipeline's terms."""
    choice: Any = body.tool_choice or "auto"
    name = None
    if isinstance(choice, NamedToolChoice):
        choice, name = "named", choice.function.name
    return OutputSpec(choice, name, body.parallel_tool_calls, body.response_format)


class ChatWriter:
    """chat.completion.chunk events and the chat.completion object (pipeline.Writer)."""

    keepalive = KEEPALIVE
    route = "chat"

    def __init__(
        self, request_id: str, model: str, fingerprint: str, body: ChatCompletionRequest
    ) -> None:
        self.request = body
        self.response_id = request_id
        self.head_fields = {
            "id": request_id,
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": fingerprint,
        }
        self._frame = ChunkFrame(ChatCompletionChunk(**self.head_fields, choices=[]))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_data(ChatCompletionChunk(**self.head_fields, choices=choices, usage=usage))

    def head(self, counts: TokenCounts) -> list[bytes]:
        """Each choice opens with the assistant role and empty content."""
        opening = ChatDelta(role="assistant", content="")
        return [
            self._chunk([ChatChunkChoice(index=index, delta=opening)])
            for index in range(self.request.n)
        ]

    def event(self, event: ChoiceEvent) -> list[bytes]:
        """A chunk for new text / reasoning / calls / logprobs; a last one with the reason.

        Per token, so built as ChatChunkChoice would serialize (ChatDelta's unset fields
        left out) without building the models: see ChunkFrame."""
        out, delta = [], event.delta
        content, reasoning = delta.content, delta.reasoning
        calls = _call_deltas(delta.tool_calls, self.request.parallel_tool_calls)
        if content or reasoning or calls or delta.logprobs:
            message: dict[str, Any] = {}
            if content:
                message["content"] = content
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            logprobs = chat_logprobs(delta.logprobs) if self.request.logprobs else None
            out.append(self._frame.data(_chunk_choice(event.index, message, logprobs)))
        if event.finish_reason is not None:
            out.append(self._frame.data(_chunk_choice(event.index, {}, None, event.finish_reason)))
        return out

    def tail(self, counts: TokenCounts) -> list[bytes]:
        """The usage chunk (when asked for), then [DONE]."""
        usage = [self._chunk([], usage=openai_usage(counts))] if self.request.include_usage else []
        return [*usage, DONE]

    def error(self, err: APIError) -> bytes:
        """The error object, then [DONE]."""
        return openai_error_event(err)

    def body(self, choices: list[FinishedChoice], counts: TokenCounts) -> ChatCompletionResponse:
        """The chat.completion object."""
        return ChatCompletionResponse(
            **self.head_fields,
            choices=[self._choice(choice) for choice in choices],
            usage=openai_usage(counts),
        )

    def _choice(self, choice: FinishedChoice) -> ChatChoice:
        result = choice.result
        calls = [
            ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in result.tool_calls
        ]
        if not self.request.parallel_tool_calls:
            calls = calls[:1]
        message = ChatMessageOut(
            content=result.content if result.content or not calls else None,
            tool_calls=calls or None,
            reasoning_content=result.reasoning or None,
        )
        logprobs = chat_logprobs(result.logprobs) if self.request.logprobs else None
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
        )


def _chunk_choice(
    index: int,
    delta: dict[str, Any],
    logprobs: ChoiceLogprobs | None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A ChatChunkChoice as a dict, in its field order (its nullable fields stay null)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _call_deltas(chunks: Sequence[ToolCallChunk], parallel: bool) -> list[dict[str, Any]]:
    """The tool-call chunks as ToolCallDelta serializes them (id, type and name only on a
    call's first chunk)."""
    out = []
    for chunk in chunks:
        if not parallel and chunk.index > 0:
            continue  # parallel_tool_calls=false: only the first call goes out
        call: dict[str, Any] = {"index": chunk.index}
        if chunk.id is not None:
            call["id"] = chunk.id
            call["type"] = "function"
        function = {} if chunk.name is None else {"name": chunk.name}
        function["arguments"] = chunk.arguments
        call["function"] = function
        out.append(call)
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
