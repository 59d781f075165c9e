"""A Lark grammar (llguidance's dialect) for Qwen3.5 tool calls of declared tools.

The model writes calls as the chat template renders them (the markup and its layout:
models/chat_format.py) and the server's parser reads them back (server/frontend/tools.py),
calls separated by "\\n". A parameter whose declared type is text (the parser's rule, as
server/frontend/tool_schema.py states it: no declared type, or "string" among them) is
kept verbatim; any other is parsed as JSON. So a text value is raw text that holds none of
the parser's closing tags (they would end it early); a typed value is JSON valid against
its schema (an inline `%json` grammar). Parameters come in schema order, required ones
always, optional ones possibly. String keywords beyond enum/const/minLength/maxLength
(pattern, format) and constrained strings inside anyOf/oneOf/allOf cannot be expressed
on raw text here: they are refused, never dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from deltaserve.engine.errors import InvalidRequestError
from deltaserve.engine.structured.spec import PARAM, ToolSpec
from deltaserve.models.chat_format import (
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    PARAMETER_VALUE_ENDS,
)

# How the template closes a value (server/frontend/tools.py strips these newlines).
_VALUE_CLOSE = "\n" + PARAMETER_CLOSE + "\n"
_STRING_KEYWORDS = ("enum", "const", "minLength", "maxLength", "pattern", "format")
_UNSUPPORTED_TEXT = ("pattern", "format", "$ref")
# What an arguments schema may say: anything else would be ignored, so it is refused.
_OBJECT_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "description", "title"}
    | {"$defs", "definitions", "$schema", "$id", "$comment", "strict", "examples", "default"}
)
# Compact JSON for typed values, the separators json.dumps uses.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_lark(
    tools: tuple[ToolSpec, ...],
    call_open: str,
    call_close: str,
    parallel: bool,
    alternative: str | None = None,
) -> str:
    """The grammar: one call (or several, when `parallel`) of `tools`, or `alternative`.

    call_open / call_close: how `<tool_call>` / `</tool_call>` are written in the grammar
    (a token reference such as `<[248058]>` when the tokenizer has them as single special
    tokens, else a quoted literal). alternative: a Lark expansion the whole output may be
    instead (e.g. an inline `%json {...}` document).
    """
    calls = 'call ("\\n" call)*' if parallel else "call"
    function_open, function_close = _literal("\n" + FUNCTION_OPEN), _literal(FUNCTION_CLOSE + "\n")
    lines = [
        f"start: {alternative} | {calls}" if alternative else f"start: {calls}",
        f"call: {call_open} {function_open} fn {function_close} {call_close}",
        "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        lines += _function_rules(i, tool)
    return "\n".join(lines) + "\n"


def _function_rules(i: int, tool: ToolSpec) -> list[str]:
    params = tool.parameters
    extra = sorted(set(params) - _OBJECT_KEYWORDS)
    _check(not extra, f"tool {tool.name!r}: {extra} on its parameters is not supported")
    _check(
        params.get("type", "object") == "object",
        f"tool {tool.name!r}: parameters must be an object schema",
    )
    props = params.get("properties", {})
    required = params.get("required", [])
    _check(isinstance(props, Mapping), f"tool {tool.name!r}: properties must be an object")
    missing = [r for r in required if r not in props]
    _check(not missing, f"tool {tool.name!r}: required {missing} not in its properties")
    body, rules = [_literal(f"{tool.name}>\n")], []
    for j, (name, schema) in enumerate(props.items()):
        where = f"tool {tool.name!r}, parameter {name!r}"
        _check(_writable_name(name), f"{where}: the name cannot be written in a tool call")
        rule = f"p_{i}_{j}"
        value = _value(rule, schema, params, where)
        rules.append(f"{rule}: {_literal(f'{PARAMETER_OPEN}{name}>' + chr(10))} {value[0]}")
        rules += value[1]
        body.append(rule if name in required else f"{rule}?")
    return [f"fn_{i}: " + " ".join(body), *rules]


def _value(rule: str, schema: Any, root: Mapping, where: str) -> tuple[str, list[str]]:
    """(expansion, extra rules) of one parameter's value and its closing tag."""
    if not isinstance(schema, Mapping):
        schema = {} if schema is True else schema
        _check(isinstance(schema, Mapping), f"{where}: the schema must be an object")
    if not is_text(schema):
        return f"%json {_json_schema(schema, root)} {_literal(_VALUE_CLOSE)}", []
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        texts = [v for v in values if isinstance(v, str)]
        _check(bool(texts), f"{where}: no string among its enum/const values")
        _check(all(_clean_text(t) for t in texts), f"{where}: a value holds a closing tag")
        return "(" + " | ".join(_literal(t + _VALUE_CLOSE) for t in texts) + ")", []
    for keyword in _UNSUPPORTED_TEXT:
        ok = keyword not in schema
        _check(ok, f"{where}: {keyword!r} on a text parameter is not supported in tool calls")
    nested = _nested_string_keywords(schema)
    _check(not nested, f"{where}: constrained strings inside {nested} are not supported")
    lexeme = rule.upper() + "_TEXT"
    return lexeme, [f"{lexeme}: {_text_regex(schema, where)}"]


def is_text(schema: Mapping) -> bool:
    """Whether the server's parser keeps this parameter's value as text (its rule)."""
    types = declared_types(schema)
    return not types or "string" in types


def declared_types(schema: Mapping) -> frozenset[str]:
    """JSON types a schema names by type / anyOf / oneOf / enum; empty when none. An
    enum with a string names "string", an all-non-string one "any" ("not a string").
    The server's tool-call parser (server/frontend/tool_schema.py) keeps a parameter's
    value as text by the same rule, so grammar and parser agree."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            found = [declared_types(o) for o in options if isinstance(o, Mapping)]
            return frozenset().union(*found)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return frozenset({"string" if any(isinstance(v, str) for v in enum) else "any"})
    return frozenset()


def _text_regex(schema: Mapping, where: str) -> str:
    """A lexeme: text of the allowed length without closing tags, then the closing tag."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    bounds_ok = isinstance(low, int) and (high is None or isinstance(high, int) and high >= low)
    _check(bounds_ok and low >= 0, f"{where}: bad minLength/maxLength")
    count = f"{{{low},{'' if high is None else high}}}"
    close = _regex_escape(_VALUE_CLOSE)
    tags = "|".join(_regex_escape(t) for t in PARAMETER_VALUE_ENDS)
    return f"/(?s:.){count}{close}/ & ~/(?s:.)*({tags})(?s:.)*{close}/"


def _nested_string_keywords(schema: Mapping) -> str:
    """The combinator whose options constrain strings (raw text cannot follow them)."""
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        for option in options if isinstance(options, list) else []:
            if not isinstance(option, Mapping):
                continue
            if any(k in option for k in (*_STRING_KEYWORDS, "$ref")):
                return key
    return ""


def _json_schema(schema: Mapping, root: Mapping) -> str:
    """The parameter's schema for an inline %json, with the tool's definitions (so
    "#/$defs/..." references still resolve) and compact, fixed whitespace."""
    inline = dict(schema)
    for defs in ("$defs", "definitions"):
        if defs in root and defs not in inline:
            inline[defs] = root[defs]
    inline["x-guidance"] = {**inline.get("x-guidance", {}), **_JSON_OPTIONS, "lenient": False}
    return json.dumps(inline, ensure_ascii=False)


def _writable_name(name: object) -> bool:
    return isinstance(name, str) and name == name.strip() and bool(name) and ">" not in name


def _clean_text(text: str) -> bool:
    return not any(tag in text for tag in PARAMETER_VALUE_ENDS)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex_escape(text: str) -> str:
    """Escape for a /.../ lexeme (Rust regex syntax, "/" closes the lexeme)."""
    special = set(r"\.+*?()|[]{}^$#&-~/")
    return "".join("\\n" if c == "\n" else ("\\" + c if c in special else c) for c in text)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, PARAM)
