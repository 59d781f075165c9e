"""OpenAI request shapes (pydantic v2); the responses are in server/responses.py.
Anthropic's are in server/messages_api.py.

Requests: unknown fields are ignored, null means "use the default", types are strict
(a string is not a number), and the checks that only make sense at the HTTP edge live
here (tool schemas, tool_choice vs tools, stop list size, and OpenAI's documented ranges
of numeric fields, e.g. temperature in [0, 2], so a value the API does not allow is a 400
naming the field before any work). deltaserve.engine.types.SamplingParams checks its own, wider,
ranges again when the route builds it (the engine serves other callers too).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_STOP_STRINGS = 16  # OpenAI allows 4; Qwen prompts often want a few more
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs (the engine's MAX_TOP_LOGPROBS)

# OpenAI's ranges (openai-openapi.yaml: CreateChatCompletionRequest and
# CreateCompletionRequest); Anthropic's narrower temperature is in server/messages_api.py.
Temperature = Annotated[float, Field(ge=0, le=2)]
Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
PositiveInt = Annotated[int, Field(ge=1)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# Thinking budgets of reasoning efforts (README); "high", "xhigh" and "max": unlimited.
EFFORT_THINKING_TOKENS = {"minimal": 256, "low": 1024, "medium": 4096}


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        # Many clients send `"n": null`, `"stream": null`, …: take the default instead.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class ImageURL(_In):
    url: str  # data: URL, file path or http(s) URL (which sources work: server/images.py)
    detail: Literal["auto", "low", "high"] = "auto"  # accepted; images keep their detail


class ContentPart(_In):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _text_or_image(self) -> ContentPart:
        if self.type not in ("text", "image_url"):
            raise ValueError(f"content parts of type {self.type!r} are not supported")
        if getattr(self, self.type) is None:
            raise ValueError(f"a {self.type!r} content part needs its {self.type!r} field")
        return self


class FunctionCallIn(_In):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients a dict


class ToolCallIn(_In):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_In):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results
    reasoning_content: str | None = None  # assistant thinking, echoed back by some clients

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(_In):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _is_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON Schema of type 'object'")
        return value


class Tool(_In):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_In):
    include_usage: bool = False


class JSONSchemaFormat(_In):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_In):
    """Enforced by a grammar (server/pipeline.py output_constraint)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_named(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a 'json_schema' response format needs its 'json_schema' field")
        return self


class SamplingFields(_In):
    """Sampling fields every generating endpoint takes (OpenAI's and our extensions)."""

    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: int | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    seed: int | None = None
    ignore_eos: bool = False
    # false: this request does not draft where the server speculates (--speculative mtp)
    speculative: bool = True

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and not all(key.isdigit() for key in value):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` keyed by int token id."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class GenerationFields(SamplingFields):
    """Fields chat and completions share."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: PositiveInt = 1  # at most deltaserve.engine.types' limit, checked there
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None  # Qwen3.5 thinks or not: template_kwargs
    # Our extension: thinking tokens before the engine closes `</think>` (wins over the
    # reasoning_effort's budget; see effort_thinking_tokens).
    max_thinking_tokens: Annotated[int, Field(ge=0)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, value: Any, info: ValidationInfo) -> Any:
        names = {tool.function.name for tool in info.data.get("tools") or []}
        if value == "required" and not names:
            raise ValueError("'required' needs at least one tool in tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"function {value.function.name!r} is not in tools")
        return value

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort applied (see thinking_kwargs)."""
        return thinking_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def thinking_tokens(self, max_tokens: int) -> int | None:
        """The thinking budget: max_thinking_tokens, else the reasoning_effort's."""
        if self.max_thinking_tokens is not None:
            return self.max_thinking_tokens
        return effort_thinking_tokens(self.reasoning_effort, max_tokens)

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (the new name) over max_tokens (deprecated)."""
        new_name = self.max_completion_tokens
        return new_name if new_name is not None else self.max_tokens


def thinking_kwargs(
    kwargs: dict[str, Any] | None, effort: ReasoningEffort | None
) -> dict[str, Any] | None:
    """Template kwargs with a reasoning effort as Qwen's enable_thinking: "none" turns
    thinking off, any other effort on, no effort leaves the model's default (it thinks).
    An explicit enable_thinking in `kwargs` wins. Chat's reasoning_effort and the
    Responses API's reasoning.effort both map here."""
    if effort is None or "enable_thinking" in (kwargs or {}):
        return kwargs
    return {**(kwargs or {}), "enable_thinking": effort != "none"}


def effort_thinking_tokens(effort: ReasoningEffort | None, max_tokens: int) -> int | None:
    """The thinking budget of a reasoning effort (EFFORT_THINKING_TOKENS), or None for
    unlimited; also None when max_tokens is no larger than the budget (the length limit
    comes first). Chat's reasoning_effort and the Responses API's reasoning.effort."""
    budget = EFFORT_THINKING_TOKENS.get(effort) if effort is not None else None
    return budget if budget is not None and budget < max_tokens else None


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(GenerationFields):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # top alternatives
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    max_tokens: int | None = 16  # the OpenAI default for this endpoint

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (len(value) == 0 or [] in value):
            raise ValueError("the prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of is not supported (use n)")
        return value

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("echo is not supported together with logprobs")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s): each a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]
