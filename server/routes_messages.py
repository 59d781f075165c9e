"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic adapter over the pipeline.

The request's blocks become OpenAI-shaped messages (server/frontend/anthropic.py), so the
prompt, images, sampling and submission are the chat route's (server/prompts.py,
server/pipeline.py); a MessagesWriter frames the choice's ordered output pieces as
content blocks: reasoning -> thinking, text -> text, a tool call -> tool_use.

Mapping: `thinking` enabled/disabled -> the template's enable_thinking (absent or
adaptive: the model's default, which thinks), enabled's budget_tokens -> the thinking
budget (pipeline.thinking_budget; no minimum here, unlike Anthropic's 1024); tool_choice
any -> "required", tool -> the named tool, none -> tools hidden,
disable_parallel_tool_use -> only the first call.
any / tool force the call by grammar (pipeline.output_constraint). stop_reason: end_turn,
max_tokens, stop_sequence (with the sequence), tool_use. usage: input_tokens +
cache_read_input_tokens is the prompt (the second is what the prefix cache restored).
Errors come in Anthropic's shape (server/errors.py picks it by path); a final assistant
message is not continued (prefill): the model answers in a new turn.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from deltaserve.server.errors import APIError
from deltaserve.server.frontend.anthropic import system_message, to_openai_messages, to_openai_tools
from deltaserve.server.frontend.choice import ChoiceStream
from deltaserve.server.frontend.pieces import Piece, Text, ToolCallStart
from deltaserve.server.messages_api import (
    ContentBlockOut,
    CountTokensRequest,
    MessageOut,
    MessagesRequest,
    MessagesUsage,
    PromptFields,
    TextBlockOut,
    ThinkingBlockOut,
    TokenCountOut,
    ToolUseBlockOut,
)
from deltaserve.server.pipeline import (
    FinishedChoice,
    OutputSpec,
    ToolChoice,
    generation_request,
    output_constraint,
    serve,
    thinking_budget,
)
from deltaserve.server.prompts import RenderedPrompt, render_prompt, template_tools
from deltaserve.server.routes_common import (
    ServerState,
    check_model,
    json_body,
    sampling_params,
    server_state,
)
from deltaserve.server.routes_generation import ChoiceEvent, TokenCounts
from deltaserve.server.sse import sse_event

router = APIRouter()
# Engine field names -> this endpoint's request fields, for 400 messages.
_FIELD_NAMES = {
    "prompt_ids": "messages",
    "images": "messages",
    "stop_token_ids": "stop_sequences",
    "max_thinking_tokens": "thinking.budget_tokens",
}
_TOOL_CHOICES: dict[str, ToolChoice] = {
    "auto": "auto",
    "any": "required",
    "tool": "named",
    "none": "none",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # the rest: end_turn
MessagesBody = Annotated[MessagesRequest, Depends(json_body(MessagesRequest))]
CountBody = Annotated[CountTokensRequest, Depends(json_body(CountTokensRequest))]


@router.post("/v1/messages")
async def create_message(request: Request, body: MessagesBody) -> Response:
    """Anthropic Messages, streaming (named SSE events) or not."""
    arrival = time.monotonic()
    state = server_state(request)
    check_model(state, body.model)
    spec = output_spec(body)
    prompt, tools = await _render(state, body, spec)
    state.metrics.images.inc(len(prompt.images))
    params = sampling_params(state, body, len(prompt.ids), body.max_tokens, _FIELD_NAMES)
    reasoning = prompt.starts_in_reasoning
    params = thinking_budget(state, params, body.thinking_tokens(), reasoning, _FIELD_NAMES)
    params = await output_constraint(state, params, spec, tools, reasoning, _FIELD_NAMES)
    message_id = "msg_" + secrets.token_hex(12)
    gen = generation_request(
        _FIELD_NAMES,
        message_id,
        prompt.ids,
        params,
        prefix_hint=prompt.history,
        images=prompt.images,
    )
    stops = body.stop_sequences or []

    def choices() -> list[ChoiceStream]:
        reasoning, parse_tools = prompt.starts_in_reasoning, tools is not None
        return [ChoiceStream(state.tokenizer, stops, tools, reasoning, parse_tools)]

    writer = MessagesWriter(message_id, state.model_name, spec.parallel_tool_calls)
    return await serve(
        request, state, [gen], choices, writer, _FIELD_NAMES, stream=body.stream, arrival=arrival
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, body: CountBody) -> Response:
    """The prompt's token count as /v1/messages would render it (images included)."""
    state = server_state(request)
    check_model(state, body.model)
    prompt, _ = await _render(state, body, output_spec(body))
    body_json = TokenCountOut(input_tokens=len(prompt.ids)).model_dump_json()
    return Response(body_json, media_type="application/json")


def output_spec(body: PromptFields) -> OutputSpec:
    """The request's tool_choice in the pipeline's terms."""
    choice = body.tool_choice
    if choice is None:
        return OutputSpec()
    name = choice.name if choice.type == "tool" else None
    return OutputSpec(_TOOL_CHOICES[choice.type], name, not choice.disable_parallel_tool_use)


async def _render(
    state: ServerState, body: PromptFields, spec: OutputSpec
) -> tuple[RenderedPrompt, list[dict[str, Any]] | None]:
    """The prompt, and the tools the template got (None: output is not parsed for calls)."""
    data = body.model_dump(exclude_none=True)
    messages, refs = to_openai_messages(data["messages"])
    messages = system_message(data.get("system")) + messages
    tools = template_tools(to_openai_tools(data.get("tools")), spec)
    kwargs = None
    if body.thinking is not None and body.thinking.type != "adaptive":
        kwargs = {"enable_thinking": body.thinking.type == "enabled"}
    return await render_prompt(state, messages, tools, kwargs, refs), tools


def stop_reason(finish_reason: str, stop_string: str | None) -> str:
    """Anthropic's stop_reason for the pipeline's finish reason."""
    if stop_string is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason, "end_turn")


def tool_use_id(call_id: str) -> str:
    """Our call id in Anthropic's style (toolu_…), the same in streams and bodies."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(counts: TokenCounts) -> MessagesUsage:
    """Anthropic's usage object (see the module docstring)."""
    return MessagesUsage(
        input_tokens=counts.num_prompt - counts.num_cached,
        output_tokens=counts.num_output,
        cache_read_input_tokens=counts.num_cached,
    )


class MessagesWriter:
    """Anthropic's stream events and message object (pipeline.Writer).

    Stream: message_start, then per block content_block_start / _delta… / _stop, then
    message_delta (stop_reason, final usage) and message_stop; `ping` while idle.
    """

    keepalive = sse_event("ping", {"type": "ping"})
    route = "messages"

    def __init__(self, message_id: str, model: str, parallel_tool_calls: bool) -> None:
        self.message_id = message_id
        self.response_id = message_id
        self.model = model
        self.is_parallel = parallel_tool_calls
        self.num_blocks = 0  # content blocks started so far; the last may be open
        self.open_type: str | None = None  # the type of the open block
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def head(self, counts: TokenCounts) -> list[bytes]:
        """message_start: the message without content, usage of the prompt."""
        message = MessageOut(
            id=self.message_id,
            model=self.model,
            content=[],
            stop_reason=None,  # known at message_delta
            stop_sequence=None,
            usage=usage(counts),
        )
        return [sse_event("message_start", {"type": "message_start", "message": _dump(message)})]

    def event(self, event: ChoiceEvent) -> list[bytes]:
        """Block events for each piece; at the choice's end its open block closes."""
        out = [chunk for piece in event.delta.pieces for chunk in self._piece(piece)]
        if event.finish_reason is not None:
            out += self._close()
            self.stop_reason = stop_reason(event.finish_reason, event.stop_string)
            self.stop_sequence = event.stop_string
        return out

    def tail(self, counts: TokenCounts) -> list[bytes]:
        """message_delta (stop reason, final usage), message_stop."""
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        message_delta = {"type": "message_delta", "delta": delta, "usage": _dump(usage(counts))}
        return [
            sse_event("message_delta", message_delta),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def error(self, err: APIError) -> bytes:
        """An `error` event in Anthropic's error shape (no [DONE] in this protocol)."""
        return sse_event("error", err.anthropic_body())

    def body(self, choices: list[FinishedChoice], counts: TokenCounts) -> MessageOut:
        """The message object."""
        (choice,) = choices
        result = choice.result
        blocks = content_blocks(result.pieces, self.is_parallel)
        reason = stop_reason(choice.finish_reason, result.stop_string)
        return MessageOut(
            id=self.message_id,
            model=self.model,
            content=blocks,
            stop_reason=reason,
            stop_sequence=result.stop_string,
            usage=usage(counts),
        )

    def _piece(self, piece: Piece) -> list[bytes]:
        if isinstance(piece, Text):
            if piece.kind == "reasoning":
                block = {"type": "thinking", "thinking": "", "signature": ""}
                delta = {"type": "thinking_delta", "thinking": piece.text}
            else:
                block = {"type": "text", "text": ""}
                delta = {"type": "text_delta", "text": piece.text}
            opening = [] if self.open_type == block["type"] else self._start(block)
            return [*opening, self._delta(delta)]
        if not self.is_parallel and piece.index > 0:
            return []  # disable_parallel_tool_use: only the first call goes out
        if isinstance(piece, ToolCallStart):
            block = {"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name}
            return self._start({**block, "input": {}})
        return [self._delta({"type": "input_json_delta", "partial_json": piece.fragment})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.open_type = block["type"]
        self.num_blocks += 1
        start = {"type": "content_block_start", "index": self.num_blocks - 1}
        return [*out, sse_event("content_block_start", {**start, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta}
        return sse_event("content_block_delta", event)

    def _close(self) -> list[bytes]:
        if self.open_type is None:
            return []
        self.open_type = None
        stop = {"type": "content_block_stop", "index": self.num_blocks - 1}
        return [sse_event("content_block_stop", stop)]


def content_blocks(pieces: tuple[Piece, ...], is_parallel: bool) -> list[ContentBlockOut]:
    """A finished choice's merged pieces as content blocks, in generation order."""
    blocks: list[ContentBlockOut] = []
    arguments: dict[int, str] = {}  # call index -> its JSON text
    calls: dict[int, ToolUseBlockOut] = {}
    for piece in pieces:
        if isinstance(piece, Text):
            is_thinking = piece.kind == "reasoning"
            text = piece.text
            blocks.append(
                ThinkingBlockOut(thinking=text) if is_thinking else TextBlockOut(text=text)
            )
        elif not is_parallel and piece.index > 0:
            continue
        elif isinstance(piece, ToolCallStart):
            calls[piece.index] = ToolUseBlockOut(
                id=tool_use_id(piece.id), name=piece.name, input={}
            )
            blocks.append(calls[piece.index])
        else:
            arguments[piece.index] = arguments.get(piece.index, "") + piece.fragment
    for index, text in arguments.items():
        # The parser's fragments always join to a JSON object (server/frontend/tools.py).
        calls[index].input = json.loads(text)
    return blocks


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json")
