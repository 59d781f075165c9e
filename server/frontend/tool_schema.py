"""Parameter types from the request's tool JSON schemas, and typing of generated values.

Qwen3.5 writes every parameter value as bare text. Whether `3` means the number 3 or the
string "3" is decided by the tool's schema: "string" (or no usable type) keeps the text;
any other declared type parses it as JSON, falling back to the text when that fails.
"""

from __future__ import annotations

import json
from typing import Any

from deltaserve.engine.structured.tool_grammar import declared_types


class ToolSchemas:
    """Per-function parameter schemas, looked up by (function name, parameter name)."""

    def __init__(self, tools: list[dict] | None) -> None:
        self._params: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                continue
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            self._params[function["name"]] = properties if isinstance(properties, dict) else {}

    def param_types(self, function: str, param: str) -> frozenset[str]:
        """The JSON types a parameter declares; empty when unknown."""
        schema = self._params.get(function, {}).get(param)
        return declared_types(schema) if isinstance(schema, dict) else frozenset()

    @staticmethod
    def is_string(types: frozenset[str]) -> bool:
        """Whether a value of these declared types stays text (unknown types do too)."""
        return not types or "string" in types


def _reject_constant(name: str) -> Any:
    # NaN / Infinity parse in Python but are not JSON: the arguments must stay valid JSON.
    raise ValueError(f"{name} is not valid JSON")


def typed_value(raw: str, types: frozenset[str]) -> Any:
    """Parse a non-string parameter's text as JSON; fall back to the text itself."""
    text = raw.strip()
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        pass
    # Python-style literals are a common slip; accept them where the schema allows.
    lowered = text.lower()
    if "boolean" in types and lowered in ("true", "false"):
        return lowered == "true"
    if "null" in types and lowered in ("none", "null"):
        return None
    return raw
