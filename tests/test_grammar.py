"""Grammar compilation, tool-call grammars, token masks and the server's mapping, without a
model: llguidance on the real Qwen3.5 vocabulary (the tiny checkpoint's tokenizer.json).

Also holds the corpus helpers test_constrained.py shares (tests/data/README.md says where
the schemas and tools come from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
import regex

from engine.constraint import Constraint, ToolSpec
from engine.constraints import RowConstraints
from engine.grammar import GrammarCompiler, grammar_compiler
from engine.noise import gumbel_noise
from engine.token_mask import allowed_ids, apply_token_mask
from engine.tool_grammar import is_text
from engine.types import InvalidRequestError, SamplingParams
from models.testing import cached_checkpoint
from models.testing.tokenizer import EOS_TOKEN_IDS, THINK_END_ID, TOOL_CALL_ID
from server.frontend.grammar import check_constraint, constraint_for, reasoning_end_id
from server.frontend.tool_schema import ToolSchemas
from server.frontend.tools import parse_tool_calls

DATA = Path(__file__).parent / "data"
VOCAB = 248320  # the test checkpoints' logits width (Qwen3.5's padded vocabulary)
# Schemas of the suite the engine refuses, and the words its error must name.
REFUSED = {
    "additionalProperties with propertyNames": "propertyNames",
    "dependentSchemas with additionalProperties": "dependentSchemas",
    "maxLength validation with a decimal": "maxLength",
    "minLength validation with a decimal": "minLength",
    "allOf with boolean schemas, some false": "Unsatisfiable",
    "allOf with boolean schemas, all false": "Unsatisfiable",
    "minProperties validation with a decimal": "minProperties",
}


# -- corpus helpers (shared with test_constrained.py) ---------------------------------------
def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Any:
    # ECMA-262 patterns such as \p{Letter} need `regex`; Python's re rejects them.
    if isinstance(instance, str) and not regex.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _pattern})


def validate(instance: Any, schema: Any) -> None:
    """jsonschema's draft 2020-12 validation, with ECMA-style patterns."""
    _Validator(schema).validate(instance)


def load_schemas() -> list[dict[str, Any]]:
    """The JSON-Schema-Test-Suite draft 2020-12 entries: {file, description, schema}."""
    return json.loads((DATA / "json_schema_suite.json").read_text(encoding="utf-8"))


def load_tools() -> list[dict[str, Any]]:
    """The BFCL functions as OpenAI tools, BFCL's own type names mapped to JSON Schema's
    (dict -> object, float -> number, as BFCL's OpenAI handler does)."""
    functions = json.loads((DATA / "bfcl_exec_simple_functions.json").read_text())
    renamed = json.loads(json.dumps(functions).replace('"dict"', '"object"'))
    renamed = json.loads(json.dumps(renamed).replace('"float"', '"number"'))
    return [{"type": "function", "function": f} for f in renamed]


def is_bounded(schema: Any, root: Any = None) -> bool:
    """Whether every document of `schema` has bounded strings (keys included), so a model
    sampling at random must close them: enums, consts, maxLength strings, numbers,
    booleans, null, and arrays / closed objects of those."""
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return schema is False
    if "enum" in schema or "const" in schema:
        return True
    if "$ref" in schema:
        name = schema["$ref"].split("/")[-1]
        return is_bounded(root.get("$defs", {}).get(name, {}), root)
    if any(is_bounded(b, root) for b in schema.get("allOf", [])):
        return True
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return all(is_bounded(b, root) for b in schema[key])
    types = schema.get("type")
    if types is None:
        return False  # any JSON value: strings and free object keys included
    types = [types] if isinstance(types, str) else types
    return all(_type_bounded(t, schema, root) for t in types)


def _type_bounded(kind: str, schema: dict, root: Any) -> bool:
    if kind == "string":
        return "maxLength" in schema
    if kind == "array":
        prefix = all(is_bounded(s, root) for s in schema.get("prefixItems", []))
        return prefix and is_bounded(schema.get("items", True), root)
    if kind == "object":
        closed = schema.get("additionalProperties", True) is False
        props = schema.get("properties", {}).values()
        return closed and all(is_bounded(p, root) for p in props)
    return True


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    path = cached_checkpoint("tiny")
    return grammar_compiler(path, VOCAB, tuple(EOS_TOKEN_IDS), 5.0)


def _walk(compiler: GrammarCompiler, constraint: Constraint, seed: int, steps: int = 80):
    """Random allowed tokens until the grammar ends: (token ids, whether it ended)."""
    rows = RowConstraints(compiler, VOCAB, EOS_TOKEN_IDS)
    rows.add("w", 1, rows.compile(constraint), SamplingParams(constraint=constraint))
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    for _ in range(steps):
        mask = rows.masks([("w", 0)])
        assert mask is not None
        ids = allowed_ids(mask.bits[0], VOCAB)
        token = int(rng.choice(ids))
        if token in EOS_TOKEN_IDS:
            return tokens, True
        tokens.append(token)
        rows.accept([("w", 0)], [token])
    return tokens, False


def _decode(compiler: GrammarCompiler, tokens: list[int]) -> str:
    return compiler.tokenizer.decode_str(tokens)


# -- schemas --------------------------------------------------------------------------------
def test_corpus_compiles_or_is_refused_by_name(compiler: GrammarCompiler) -> None:
    """Every suite schema compiles, or is refused with an error naming what it cannot do;
    at least 50 compile (the corpus test_constrained.py generates from)."""
    compiled = 0
    for entry in load_schemas():
        spec = Constraint("json_schema", schema=entry["schema"])
        word = REFUSED.get(entry["description"])
        if word is None:
            compiler.compile(spec)
            compiled += 1
            continue
        with pytest.raises(InvalidRequestError, match=word) as info:
            compiler.compile(spec)
        assert info.value.param == "constraint"
    assert compiled == len(load_schemas()) - len(REFUSED) >= 50


@pytest.mark.parametrize(
    ("schema", "word"),
    [
        ({"type": "string", "not": {"const": "a"}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "x-guidance": {"lenient": True}, "propertyNames": {}}, "propertyNames"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ({"$ref": "https://example.com/remote.json"}, "example.com"),
    ],
)
def test_unsupported_keywords_are_refused_not_dropped(
    compiler: GrammarCompiler, schema: dict, word: str
) -> None:
    """An unimplemented keyword is an InvalidRequestError naming it (a schema cannot turn
    lenient mode on for itself)."""
    with pytest.raises(InvalidRequestError, match=word):
        compiler.compile(Constraint("json_schema", schema=schema))


def test_compile_time_limit(compiler: GrammarCompiler) -> None:
    """A compile past the time limit is refused, saying so."""
    compiler.tokenizer  # noqa: B018 - loaded first: its one-off load is not timed
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    limit, compiler.timeout_s = compiler.timeout_s, 1e-4
    try:
        with pytest.raises(InvalidRequestError, match="did not compile within"):
            compiler.compile(Constraint("json_schema", schema=schema))
    finally:
        compiler.timeout_s = limit


def test_compiles_are_cached(compiler: GrammarCompiler) -> None:
    spec = {"type": "object", "properties": {"cached": {"type": "integer"}}}
    first = compiler.compile(Constraint("json_schema", schema=spec))
    assert compiler.compile(Constraint("json_schema", schema=dict(spec))) is first


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_are_valid_documents(compiler: GrammarCompiler, seed: int) -> None:
    """Uniformly random allowed tokens over bounded schemas end in documents that parse and
    validate (the grammar is sound on its own, before any model)."""
    for entry in load_schemas():
        if entry["description"] in REFUSED or not is_bounded(entry["schema"]):
            continue
        tokens, ended = _walk(compiler, Constraint("json_schema", schema=entry["schema"]), seed)
        assert ended, entry["description"]
        validate(json.loads(_decode(compiler, tokens)), entry["schema"])


def test_json_output_is_compact(compiler: GrammarCompiler) -> None:
    """Fixed separators: no runs of whitespace a sampler could wander into."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["a"],
        "additionalProperties": False,
    }
    tokens, ended = _walk(compiler, Constraint("json_schema", schema=schema), seed=0)
    assert ended
    text = _decode(compiler, tokens)
    assert text == json.dumps(json.loads(text))


# -- tool calls -----------------------------------------------------------------------------
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
    assert ids[0] == TOOL_CALL_ID
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


def _bounded_strings(tools: list[dict]) -> list[dict]:
    """The tools with a maxLength on their string parameters (random text rarely closes)."""
    out = json.loads(json.dumps(tools))
    for tool in out:
        for schema in tool["function"]["parameters"]["properties"].values():
            if schema.get("type") == "string":
                schema["maxLength"] = 12
    return out


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


# -- rows and masks -------------------------------------------------------------------------
def test_row_is_free_until_its_start_token(compiler: GrammarCompiler) -> None:
    """start_after_token_id: no mask while reasoning; the grammar's first mask after it."""
    spec = Constraint("json_object", start_after_token_id=THINK_END_ID)
    rows = RowConstraints(compiler, VOCAB, EOS_TOKEN_IDS)
    rows.add("r", 2, rows.compile(spec), SamplingParams(constraint=spec))
    keys = [("r", 0), ("r", 1)]
    assert rows.masks(keys) is None
    rows.accept(keys, [100, THINK_END_ID])  # choice 1 closes its reasoning, choice 0 not
    mask = rows.masks(keys)
    assert mask is not None and mask.rows == (1,)
    assert len(allowed_ids(mask.bits[0], VOCAB)) == VOCAB  # choice 0 still free
    opening = allowed_ids(mask.bits[1], VOCAB)
    assert all(_decode(compiler, [int(t)]).startswith("{") for t in opening)
    rows.release(keys)
    assert len(rows) == 0


def test_a_refused_token_ends_the_row(compiler: GrammarCompiler) -> None:
    """A matcher that fails (a token its mask did not allow) leaves only EOS."""
    spec = Constraint("json_object")
    rows = RowConstraints(compiler, VOCAB, EOS_TOKEN_IDS)
    rows.add("r", 1, rows.compile(spec), SamplingParams(constraint=spec))
    rows.accept([("r", 0)], compiler.tokenizer.tokenize_str("hello"))
    mask = rows.masks([("r", 0)])
    assert mask is not None and sorted(allowed_ids(mask.bits[0], VOCAB)) == sorted(EOS_TOKEN_IDS)


@pytest.mark.parametrize("vocab", [VOCAB, 1000, 1001])
def test_token_mask_is_exact(vocab: int) -> None:
    """Allowed logits pass unchanged, every other one is exactly -inf (no NaN), for any
    vocabulary size (a partial last word included)."""
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 30
    bits = rng.integers(-(2**31), 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64)
    bits = bits.astype(np.int32)
    got = np.array(apply_token_mask(mx.array(logits), bits))
    flags = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    np.testing.assert_array_equal(got, np.where(flags, logits, -np.inf))


def test_gumbel_noise_is_finite_at_the_top_hash_value() -> None:
    """The largest hash draws u < 1 (it once rounded to 1.0: infinite noise, NaN on -inf)."""
    key = np.array([[0x12345678, 0x9ABCDEF0]], dtype=np.uint32)
    ids = np.arange(1 << 24, dtype=np.uint32)
    noise = np.array(gumbel_noise(mx.array(key[:, :1]), mx.array(key[:, 1:]), mx.array(ids)))
    assert np.isfinite(noise).all()
    assert noise.max() > 15  # the top of 2^24 draws was in range: about -log(-log(1 - 2^-24))


# -- the server's mapping -------------------------------------------------------------------
def test_response_format_mapping() -> None:
    schema = {"type": "object"}
    assert constraint_for(None, None, None) is None
    assert constraint_for({"type": "text"}, "auto", None) is None
    assert constraint_for({"type": "json_object"}, None, None).kind == "json_object"
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    c = constraint_for(fmt, None, None, reasoning_end_id=THINK_END_ID)
    assert (c.kind, c.schema, c.strict, c.start_after_token_id) == (
        "json_schema",
        schema,
        True,
        THINK_END_ID,
    )
    with pytest.raises(InvalidRequestError) as info:
        constraint_for({"type": "bad"}, None, None)
    assert info.value.param == "response_format"


def test_tool_choice_mapping() -> None:
    tools = load_tools()
    forced = constraint_for(None, "required", tools)
    assert forced.kind == "tool_calls" and len(forced.tools) == len(tools) and forced.parallel_calls
    named = constraint_for({"type": "json_object"}, "named", tools, tool_name="math_gcd")
    assert named.kind == "tool_calls" and [t.name for t in named.tools] == ["math_gcd"]
    assert not named.parallel_calls  # one call of the named function
    either = constraint_for({"type": "json_object"}, "auto", tools)
    assert either.kind == "json_object" and len(either.tools) == len(tools)
    assert constraint_for({"type": "json_object"}, "none", tools).tools == ()
    assert constraint_for(None, "auto", tools) is None
    with pytest.raises(InvalidRequestError) as info:
        constraint_for(None, "named", tools, tool_name="nope")
    assert info.value.param == "tool_choice"


def test_reasoning_end_id_and_compile_errors_name_the_field(compiler: GrammarCompiler) -> None:
    assert (
        reasoning_end_id(lambda text: compiler.tokenizer.tokenize_str(text, parse_special=True))
        == THINK_END_ID
    )
    bad = constraint_for(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}, None, None
    )
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(cached_checkpoint("tiny"), bad)
    assert info.value.param == "response_format" and "not" in str(info.value)
