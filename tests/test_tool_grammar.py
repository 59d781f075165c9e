"""Tool-call grammars without a model: llguidance on the real Qwen3.5 vocabulary. The grammar
takes the chat template's rendering, random walks through it are calls the server's parser
reads as declared tools with valid arguments, parameters it cannot force are refused, its
text/JSON rule agrees with the parser's, and a JSON format may share it with tool calls.
"""

from __future__ import annotations

import json

import pytest
from grammar_corpus import (
    _bounded_strings,
    _decode,
    _walk,
    compiler_fixture,  # noqa: F401 - the `compiler` fixture
    load_tools,
    validate,
)

from deltaserve.engine.structured.grammar import GrammarCompiler
from deltaserve.engine.structured.spec import Constraint, ToolSpec
from deltaserve.engine.structured.tool_grammar import is_text
from deltaserve.engine.types import InvalidRequestError
from deltaserve.models.chat_format import TOOL_CALL_OPEN_ID
from deltaserve.server.frontend.tool_schema import ToolSchemas
from deltaserve.server.frontend.tools import parse_tool_calls


def _tool_specs() -> tuple[ToolSpec, ...]:
    return tuple(ToolSpec(t["function"]["name"], t["function"]["parameters"]) for t in load_tools())


def test_tool_call_grammar_accepts_the_template_rendering(compiler: GrammarCompiler) -> None:
    """The grammar takes a call exactly as the chat template writes it."""
    spec = Constraint("tool_calls", tools=_tool_specs())
    text = (
        "<tool_call>\n<function=math_gcd>\n<parameter=a>\n450\n</parameter>\n"
        "<parameter=b>\n300\n</parameter>\n</function>\n</tool_call>"
    )
    matcher = compiler.compile(spec).matcher.deep_copy()
    ids = compiler.tokenizer.tokenize_str(text, parse_special=True)
    assert ids[0] == TOOL_CALL_OPEN_ID
    assert matcher.consume_tokens(ids), matcher.get_error()
    assert matcher.is_accepting()


@pytest.mark.parametrize("seed", range(6))
def test_random_tool_calls_parse_to_declared_tools_with_valid_arguments(
    compiler: GrammarCompiler, seed: int
) -> None:
    """Random walks through the tool grammar are calls the server's parser reads as
    declared tools whose arguments validate against their schemas."""
    tools = load_tools()
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    bounded = _bounded_strings(tools)
    specs = tuple(ToolSpec(t["function"]["name"], t["function"]["parameters"]) for t in bounded)
    spec = Constraint("tool_calls", tools=specs)
    tokens, ended = _walk(compiler, spec, seed, steps=400)
    assert ended
    content, calls = parse_tool_calls(_decode(compiler, tokens), tools)
    assert content == "" and calls
    for call in calls:
        validate(json.loads(call.arguments), by_name[call.name])


@pytest.mark.parametrize(
    ("parameters", "word"),
    [
        ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a$"}}}, "pattern"),
        ({"type": "object", "properties": {"s": {"type": "string", "format": "date"}}}, "format"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
        ({"type": "object", "properties": {}, "minProperties": 1}, "minProperties"),
        ({"type": "object", "properties": {"a>b": {"type": "integer"}}}, "name"),
    ],
)
def test_tool_parameters_the_grammar_cannot_force_are_refused(
    compiler: GrammarCompiler, parameters: dict, word: str
) -> None:
    with pytest.raises(InvalidRequestError, match=word):
        compiler.compile(Constraint("tool_calls", tools=(ToolSpec("f", parameters),)))


def test_text_parameters_follow_the_parsers_rule() -> None:
    """engine/tool_grammar.is_text agrees with server/frontend/tool_schema on which values
    stay text (the engine may not import the server)."""
    schemas = [
        {},
        {"type": "string"},
        {"type": ["string", "null"]},
        {"type": "integer"},
        {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
        {"enum": ["a", 1]},
        {"enum": [1, 2]},
        {"description": "no type"},
        *[p for t in load_tools() for p in t["function"]["parameters"]["properties"].values()],
    ]
    for schema in schemas:
        tools = [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"properties": {"x": schema}}},
            }
        ]
        parser = ToolSchemas(tools)
        assert is_text(schema) == parser.is_string(parser.param_types("f", "x")), schema


def test_json_or_tool_calls(compiler: GrammarCompiler) -> None:
    """A JSON format with callable tools: the document, or tool calls, nothing else."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    spec = Constraint("json_schema", schema=schema, tools=_tool_specs()[:2])
    template = compiler.compile(spec).matcher
    for text, special in (('{"x": 3}', False), ("<tool_call>\n<function=calc", True)):
        matcher = template.deep_copy()
        assert matcher.consume_tokens(compiler.tokenizer.tokenize_str(text, parse_special=special))
    matcher = template.deep_copy()
    assert not matcher.consume_tokens(compiler.tokenizer.tokenize_str("hello"))
