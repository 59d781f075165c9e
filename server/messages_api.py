"""Anthropic Messages API shapes (pydantic v2): requests and responses of /v1/messages.

Requests follow server/schemas.py's rules (unknown fields ignored, null = unset, strict
types). Content blocks are told apart by `type`; those this server cannot use (documents,
server tools' results) are a 400 naming the block. The sampling extensions of the OpenAI
routes (min_p, penalties, logit_bias, seed, ignore_eos) are accepted here too, with the
OpenAI routes' ranges, except temperature: Anthropic's is [0, 1].
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from deltaserve.server.responses import _Out
from deltaserve.server.schemas import MAX_STOP_STRINGS, PositiveInt, SamplingFields, _In


class TextBlockIn(_In):
    type: Literal["text"]
    text: str


class Base64Source(_In):
    type: Literal["base64"]
    media_type: str  # image/jpeg, image/png, image/gif or image/webp
    data: str


class URLSource(_In):
    type: Literal["url"]
    url: str


class ImageBlockIn(_In):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class ToolUseBlockIn(_In):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ToolResultContent = Annotated[TextBlockIn | ImageBlockIn, Field(discriminator="type")]


class ToolResultBlockIn(_In):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContent] = ""
    is_error: bool = False


class ThinkingBlockIn(_In):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # ours are empty; Anthropic's are opaque and ignored here


class RedactedThinkingBlockIn(_In):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockIn = Annotated[
    TextBlockIn
    | ImageBlockIn
    | ToolUseBlockIn
    | ToolResultBlockIn
    | ThinkingBlockIn
    | RedactedThinkingBlockIn,
    Field(discriminator="type"),
]


class MessageIn(_In):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockIn]


class ToolIn(_In):
    type: Literal["custom"] | None = None  # server tools (web search, …) are not served
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("input_schema")
    @classmethod
    def _is_object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("input_schema must be a JSON Schema of type 'object'")
        return value


class ToolChoiceIn(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingIn(_In):
    """enabled / disabled switch Qwen's thinking (the template's enable_thinking);
    adaptive keeps the model's default (it thinks). enabled's budget_tokens: thinking
    tokens before the engine closes `</think>` (absent: unlimited; ignored otherwise)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None


class PromptFields(_In):
    """What renders the prompt: shared by messages and count_tokens."""

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlockIn] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, value: ToolChoiceIn | None, info: ValidationInfo) -> Any:
        names = {tool.name for tool in info.data.get("tools") or []}
        if value is None:
            return value
        if value.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {value.type!r} needs at least one tool in tools")
        if value.type == "tool" and value.name not in names:
            raise ValueError(f"tool {value.name!r} is not in tools")
        return value


class CountTokensRequest(PromptFields):
    """POST /v1/messages/count_tokens."""


class MessagesRequest(PromptFields, SamplingFields):
    """POST /v1/messages."""

    max_tokens: PositiveInt
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted and ignored

    def thinking_tokens(self) -> int | None:
        """The thinking budget: enabled thinking's budget_tokens (None: unlimited)."""
        thinking = self.thinking
        return thinking.budget_tokens if thinking and thinking.type == "enabled" else None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and "" in value:
            raise ValueError("stop sequences must not be empty")
        return value


class TextBlockOut(_Out):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlockOut(_Out):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; there is nothing to sign here


class ToolUseBlockOut(_Out):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlockOut = TextBlockOut | ThinkingBlockOut | ToolUseBlockOut


class MessagesUsage(_Out):
    """Anthropic's usage: input_tokens + cache_read_input_tokens = the whole prompt."""

    input_tokens: int  # prompt tokens not read from the cache
    output_tokens: int
    cache_creation_input_tokens: int = 0  # snapshots are taken as a side effect, not billed
    cache_read_input_tokens: int = 0  # prompt tokens restored from the prefix cache


class MessageOut(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlockOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessagesUsage


class TokenCountOut(_Out):
    input_tokens: int
