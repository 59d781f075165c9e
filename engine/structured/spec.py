"""What a request's output must match: a constraint spec, checked for shape once here.

Plain data (no grammar engine here): engine/structured/grammar.py compiles a Constraint into a
grammar, engine/structured/matchers.py runs one matcher per constrained row. Written by the
server (server/frontend/grammar.py builds it from `response_format` / `tool_choice`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deltaserve.engine.errors import InvalidRequestError

PARAM = "constraint"  # the SamplingParams field that errors name
KINDS = ("json_object", "json_schema", "regex", "lark", "tool_calls")
JSON_KINDS = ("json_object", "json_schema")
# A function name goes into the call markup `<function=NAME>`: no markup characters.
_TOOL_NAME = re.compile(r"[^<>\s]{1,128}")


@dataclass(frozen=True)
class ToolSpec:
    """One callable tool: its name and the JSON schema of its arguments (an object)."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Constraint:
    """The language a row's output must belong to.

    kind: "json_object" (any JSON object), "json_schema" (`schema`), "regex" / "lark"
    (`grammar`: a regex the whole output matches, or a Lark grammar in llguidance's
    dialect), "tool_calls" (one or more Qwen3.5 XML tool calls of `tools`, arguments valid
    against each tool's `parameters`; only one when `parallel_calls` is False). The JSON
    kinds with `tools`: the document, or else tool calls of those tools.
    strict (json_schema): True never approximates the schema; False lets the compiler
    treat `oneOf` as `anyOf` where it cannot prove them equal. Unsupported keywords are an
    error either way.
    start_after_token_id: the output is free until this token is generated (e.g.
    `</think>` when the prompt opens a reasoning block); the constraint applies after it.
    Errors name the engine field "constraint"; the message names the problem.
    """

    kind: str
    schema: Mapping[str, Any] | bool | None = None
    grammar: str = ""
    tools: tuple[ToolSpec, ...] = ()
    parallel_calls: bool = True
    strict: bool = False
    start_after_token_id: int | None = None

    def __post_init__(self) -> None:
        _require(self.kind in KINDS, f"unknown constraint kind {self.kind!r}")
        if self.kind == "json_schema":
            ok = isinstance(self.schema, Mapping | bool)
            _require(ok, "json_schema needs a schema object")
        if self.kind in ("regex", "lark"):
            _require(bool(self.grammar), f"an empty {self.kind} grammar")
        if self.kind == "tool_calls" or self.tools:
            _require(self.kind in ("tool_calls", *JSON_KINDS), f"{self.kind} with tools")
            _check_tools(self.tools)
        if self.start_after_token_id is not None:
            _require(self.start_after_token_id >= 0, "bad start token id")

    def key(self) -> str:
        """Text that identifies what compiles from this spec (the compile cache's key)."""
        tools = [[t.name, t.parameters] for t in self.tools]
        spec = [self.kind, self.schema, self.grammar, tools, self.parallel_calls, self.strict]
        return json.dumps(spec, sort_keys=True, default=_unserializable)


def _check_tools(tools: tuple[ToolSpec, ...]) -> None:
    _require(bool(tools), "a forced tool call needs at least one tool")
    names = [t.name for t in tools]
    _require(len(set(names)) == len(names), "tool names must be unique")
    for tool in tools:
        ok = isinstance(tool.name, str) and _TOOL_NAME.fullmatch(tool.name) is not None
        _require(ok, f"tool name {tool.name!r} cannot be written in a tool call")
        ok = isinstance(tool.parameters, Mapping)
        _require(ok, f"tool {tool.name!r}: parameters must be a JSON schema object")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, PARAM)


def _unserializable(value: object) -> str:
    raise InvalidRequestError(f"the schema holds a non-JSON value: {value!r}", PARAM)
