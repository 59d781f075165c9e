"""OpenAI `response_format` and forced `tool_choice` as an engine Constraint.

- `tool_choice` "required" (or a named function) forces Qwen3.5 tool calls of the tools
  (only the named one), one call unless `parallel_tool_calls`; it wins over any
  `response_format`, since a forced call leaves no content to shape.
- `response_format` json_object / json_schema constrains the content; when tools are
  offered and may be called ("auto"), the output is the document *or* tool calls.
- "text", no format, or tool_choice "none"/"auto" without a format: no constraint.
- When the prompt opens a reasoning block (thinking on), the constraint starts after the
  model's `</think>`: the reasoning stays free.

Malformed fields are a 400 naming `response_format` or `tools`; so is a schema the engine
cannot compile (check_constraint compiles it here, off the engine thread).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from deltaserve.engine.structured.grammar import find_compiler
from deltaserve.engine.structured.spec import Constraint, ToolSpec
from deltaserve.engine.types import InvalidRequestError
from deltaserve.models.chat_format import THINK_CLOSE

_JSON_KINDS = ("json_object", "json_schema")


def constraint_for(
    response_format: Any,
    tool_choice: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    tool_name: str | None = None,
    parallel_tool_calls: bool = True,
    reasoning_end_id: int | None = None,
) -> Constraint | None:
    """The constraint a request asks for, or None.

    response_format: the request's object (pydantic or dict: {"type": ..., "json_schema":
    {"name", "schema", "strict"}}). tool_choice: "auto" / "none" / "required" / "named"
    (then `tool_name`), or None for "auto". tools: OpenAI tool objects ({"type":
    "function", "function": {...}}) or bare function objects. reasoning_end_id: the
    `</think>` token id when the output starts inside reasoning, else None.
    """
    specs = _tool_specs(tools)
    if tool_choice in ("required", "named"):
        if tool_choice == "named":
            specs = tuple(s for s in specs if s.name == tool_name)
        _require(bool(specs), f"no tool named {tool_name!r} in tools", "tool_choice")
        return _build(
            "tools",
            kind="tool_calls",
            tools=specs,
            parallel_calls=parallel_tool_calls and tool_choice == "required",
            start_after_token_id=reasoning_end_id,
        )
    fmt = _as_dict(response_format)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    _require(kind in _JSON_KINDS, f"unknown response_format type {kind!r}", "response_format")
    schema, strict = _schema(fmt) if kind == "json_schema" else (None, False)
    callable_tools = specs if tool_choice in (None, "auto") else ()
    return _build(
        "response_format",
        kind="json_schema" if schema is not None else "json_object",
        schema=schema,
        strict=strict,
        tools=callable_tools,
        start_after_token_id=reasoning_end_id,
    )


def reasoning_end_id(encode: Callable[[str], list[int]]) -> int | None:
    """The token id of `</think>` (Qwen3.5 has it as one added token), or None."""
    ids = encode(THINK_CLOSE)
    return ids[0] if len(ids) == 1 else None


def constraint_field(constraint: Constraint) -> str:
    """The request field a constraint came from (for a 400 about it)."""
    return "tools" if constraint.kind == "tool_calls" else "response_format"


def check_constraint(model_dir: str | Path, constraint: Constraint) -> None:
    """Compile `constraint` now (blocking: call it in a thread pool) so that a schema the
    engine cannot compile is a 400 naming its field; the engine then finds it compiled.
    Does nothing without an engine in this process (a test's fake engine)."""
    compiler = find_compiler(Path(model_dir))
    if compiler is None:
        return
    try:
        compiler.compile(constraint)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), constraint_field(constraint)) from None


def _tool_specs(tools: Sequence[Mapping[str, Any]] | None) -> tuple[ToolSpec, ...]:
    specs = []
    for tool in _as_list(tools):
        function = _as_dict(tool.get("function", tool))
        name = function.get("name")
        _require(isinstance(name, str), "a tool without a function name", "tools")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        _require(isinstance(parameters, Mapping), f"tool {name!r}: bad parameters", "tools")
        specs.append(ToolSpec(name, parameters))
    return tuple(specs)


def _schema(fmt: Mapping[str, Any]) -> tuple[Mapping[str, Any] | bool | None, bool]:
    """(schema, strict) of a json_schema response_format; no schema: any JSON object."""
    spec = _as_dict(fmt.get("json_schema"))
    schema = spec.get("schema", spec.get("schema_"))
    ok = schema is None or isinstance(schema, Mapping | bool)
    _require(ok, "response_format.json_schema.schema must be an object", "response_format")
    return schema, bool(spec.get("strict"))


def _build(field: str, **fields: Any) -> Constraint:
    """A Constraint whose shape errors name the request field it came from."""
    try:
        return Constraint(**fields)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), field) from None


def _as_dict(value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if hasattr(value, "model_dump"):  # a pydantic request model: its wire names
        return value.model_dump(by_alias=True, exclude_none=True)
    _require(isinstance(value, Mapping), "expected an object", "response_format")
    return value


def _as_list(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    return [_as_dict(t) for t in tools or []]


def _require(ok: bool, message: str, field: str) -> None:
    if not ok:
        raise InvalidRequestError(message, field)
