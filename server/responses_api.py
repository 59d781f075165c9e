"""OpenAI Responses API shapes (pydantic v2): the request of POST /v1/responses and the
Response object (openai-openapi.yaml: CreateResponse, Response, OutputItem, ResponseUsage).

Requests follow server/schemas.py's rules (unknown fields ignored, null = unset, strict
types). Input items: messages (text and image parts; assistant messages with output_text,
as a client sends an earlier output back), function_call, function_call_output and
reasoning; any other item, tool or content type is a 400 naming it. The sampling
extensions of the other routes (top_k, min_p, penalties, logit_bias, seed, ignore_eos)
are accepted too. Stream events are plain dicts, written in server/responses_writer.py.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from deltaserve.server.responses import _Out
from deltaserve.server.schemas import FunctionDef, ReasoningEffort, SamplingFields, _In

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class InputTextIn(_In):
    type: Literal["input_text"]
    text: str


class InputImageIn(_In):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL, or what images.* settings allow
    file_id: str | None = None  # no Files API here: refused
    detail: Literal["auto", "low", "high"] = "auto"  # accepted; images keep their detail

    @model_validator(mode="after")
    def _has_url(self) -> InputImageIn:
        if self.image_url is None:
            raise ValueError("input_image needs image_url (file_id is not supported)")
        return self


class OutputTextIn(_In):
    """An earlier answer sent back as input (assistant messages)."""

    type: Literal["output_text"]
    text: str


class RefusalIn(_In):
    type: Literal["refusal"]
    refusal: str


ContentIn = Annotated[
    InputTextIn | InputImageIn | OutputTextIn | RefusalIn, Field(discriminator="type")
]


class MessageItemIn(_In):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentIn]


class FunctionCallItemIn(_In):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class FunctionCallOutputItemIn(_In):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[InputTextIn]


class ReasoningPartIn(_In):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItemIn(_In):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPartIn] = []
    content: list[ReasoningPartIn] = []


def _item_type(item: Any) -> str | None:
    """An item's type; a message may leave it out (EasyInputMessage)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItemIn = Annotated[
    Annotated[MessageItemIn, Tag("message")]
    | Annotated[FunctionCallItemIn, Tag("function_call")]
    | Annotated[FunctionCallOutputItemIn, Tag("function_call_output")]
    | Annotated[ReasoningItemIn, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionToolIn(FunctionDef):
    """A function tool: Responses flattens chat's {"type", "function": {...}} into one."""

    type: Literal["function"]


class NamedFunctionIn(_In):
    type: Literal["function"]
    name: str


class TextFormatIn(_In):
    """text.format: Responses' flat form of chat's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_when_named(self) -> TextFormatIn:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a 'json_schema' format needs its 'name' and 'schema'")
        return self


class TextIn(_In):
    format: TextFormatIn | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored


class ReasoningIn(_In):
    """effort "none" turns Qwen's thinking off, any other on (schemas.thinking_kwargs);
    minimal, low and medium also bound it (schemas.effort_thinking_tokens). summary is
    accepted and ignored: the reasoning itself comes back."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class CreateResponseRequest(SamplingFields):
    """POST /v1/responses."""

    model: str | None = None
    input: str | Annotated[list[InputItemIn], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionIn | None = None
    parallel_tool_calls: bool = True
    text: TextIn | None = None
    reasoning: ReasoningIn | None = None
    max_output_tokens: Annotated[int, Field(ge=16)] | None = None  # the spec's minimum
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None  # echoed back
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat; wins over reasoning

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, value: Any) -> Any:
        for i, item in enumerate(value if isinstance(value, list) else []):
            kind = _item_type(item) if isinstance(item, dict) else None
            if kind not in ITEM_TYPES:
                supported = ", ".join(ITEM_TYPES)
                raise ValueError(f"item {i} has type {kind!r}; supported: {supported}")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} has type {kind!r}; only function tools are served")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, value: Any, info: ValidationInfo) -> Any:
        names = {tool.name for tool in info.data.get("tools") or []}
        if value == "required" and not names:
            raise ValueError("'required' needs at least one tool in tools")
        if isinstance(value, NamedFunctionIn) and value.name not in names:
            raise ValueError(f"function {value.name!r} is not in tools")
        return value


# Responses ---------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextOut(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningTextOut(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageOut(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputTextOut]


class ReasoningOut(_Out):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = []
    content: list[ReasoningTextOut]


class FunctionCallOut(_Out):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItemOut = MessageOut | ReasoningOut | FunctionCallOut


class InputTokensDetails(_Out):
    cached_tokens: int  # prompt tokens restored from the prefix cache
    cache_write_tokens: int = 0  # snapshots are a side effect, not billed


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int  # the whole prompt, cached tokens included
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseOut(_Out):
    """The Response object: streamed in response.* events, returned, stored."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None
    error: None = None  # a failure is an `error` stream event or an error response
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItemOut]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]  # {"effort", "summary"}, as asked
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]  # {"format": {...}}, as asked
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None  # set once the response finished
    metadata: dict[str, str]


class ResponseItemList(_Out):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str  # "" when data is empty
    last_id: str
    has_more: bool


class DeletedResponse(_Out):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
