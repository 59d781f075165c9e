"""OpenAI response shapes (pydantic v2); the requests are in server/schemas.py.

Responses serialize exactly as the OpenAI spec shows them: `null` where the spec has a
nullable field (`logprobs`, `refusal`, `finish_reason`), while our optional extras
(`tool_calls`, `reasoning_content`, `usage` on stream chunks) are left out when unset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, model_serializer

if TYPE_CHECKING:
    from deltaserve.server.routes_generation import TokenCounts


class _Out(BaseModel):
    """Response base: fields in `omit_if_none` are dropped when None, others stay null."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unset_extras(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_if_none}


class PromptTokensDetails(_Out):
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


def openai_usage(counts: TokenCounts) -> Usage:
    """OpenAI's usage object (cached prompt tokens in prompt_tokens_details)."""
    return Usage(
        prompt_tokens=counts.num_prompt,
        completion_tokens=counts.num_output,
        total_tokens=counts.num_prompt + counts.num_output,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.num_cached),
    )


class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text, as generated


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(_Out):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"name", "arguments"})
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"id", "type", "function"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class ChatMessageOut(_Out):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"tool_calls", "reasoning_content"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # Qwen thinking, vLLM's field name


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Out):
    omit_if_none: ClassVar[frozenset[str]] = frozenset(
        {"role", "content", "reasoning_content", "tool_calls"}
    )
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Out):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None  # null only on stream chunks before the last


class CompletionResponse(_Out):
    """Both the response and each stream chunk (the endpoint uses one shape for both)."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deltaserve"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]
