"""Grammar compilation, token masks and the server's mapping, without a model: llguidance on
the real Qwen3.5 vocabulary (the tiny checkpoint's tokenizer.json). Schemas of the corpus
compile or are refused by name, random walks end in valid compact documents, rows stay free
until their start token, masks are exact, and response_format / tool_choice map to
constraints. Tool-call grammars are in test_tool_grammar.py, the shared corpus helpers in
grammar_corpus.py.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from grammar_corpus import (
    REFUSED,
    VOCAB,
    _decode,
    _walk,
    compiler_fixture,  # noqa: F401 - the `compiler` fixture
    is_bounded,
    load_schemas,
    load_tools,
    validate,
)

from deltaserve.engine.sampling.noise import gumbel_noise
from deltaserve.engine.structured.grammar import GrammarCompiler
from deltaserve.engine.structured.matchers import RowConstraints
from deltaserve.engine.structured.spec import Constraint
from deltaserve.engine.structured.token_mask import allowed_ids, apply_token_mask
from deltaserve.engine.types import InvalidRequestError, SamplingParams
from deltaserve.models.chat_format import THINK_CLOSE_ID
from deltaserve.models.testing import cached_checkpoint
from deltaserve.models.testing.tokenizer import EOS_TOKEN_IDS
from deltaserve.server.frontend.grammar import check_constraint, constraint_for, reasoning_end_id


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


# -- rows and masks -------------------------------------------------------------------------
def test_row_is_free_until_its_start_token(compiler: GrammarCompiler) -> None:
    """start_after_token_id: no mask while reasoning; the grammar's first mask after it."""
    spec = Constraint("json_object", start_after_token_id=THINK_CLOSE_ID)
    rows = RowConstraints(compiler, VOCAB, EOS_TOKEN_IDS)
    rows.add(["r/0", "r/1"], rows.compile(spec), SamplingParams(constraint=spec))
    keys = ["r/0", "r/1"]
    assert rows.masks(keys) is None
    rows.accept(keys, [100, THINK_CLOSE_ID])  # choice 1 closes its reasoning, choice 0 not
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
    rows.add(["r/0"], rows.compile(spec), SamplingParams(constraint=spec))
    rows.accept(["r/0"], compiler.tokenizer.tokenize_str("hello"))
    mask = rows.masks(["r/0"])
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
    c = constraint_for(fmt, None, None, reasoning_end_id=THINK_CLOSE_ID)
    assert (c.kind, c.schema, c.strict, c.start_after_token_id) == (
        "json_schema",
        schema,
        True,
        THINK_CLOSE_ID,
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
        == THINK_CLOSE_ID
    )
    bad = constraint_for(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}, None, None
    )
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(cached_checkpoint("tiny"), bad)
    assert info.value.param == "response_format" and "not" in str(info.value)
