"""Constrained decoding in the engine, on random-weight checkpoints.

At temperature 1 the model writes whatever the grammar lets through: every output that
ends with "stop" must parse and validate, every output cut by max_tokens must be a prefix
of a valid document, and forced tool calls must name declared tools with valid
arguments. Greedy runs on the peaked tiny checkpoint prove batched == alone with
constrained and free rows in one batch, forks and pipelining included.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import numpy as np
import pytest
from grammar_corpus import (
    REFUSED,
    _bounded_strings,
    is_bounded,
    load_schemas,
    load_tools,
    validate,
)
from tokenizers import Tokenizer

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Completion, LLMEngine
from deltaserve.engine.structured.spec import Constraint
from deltaserve.engine.structured.token_mask import allowed_ids
from deltaserve.engine.types import GenerationRequest, InvalidRequestError, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.chat_format import THINK_CLOSE_ID
from deltaserve.models.testing import cached_checkpoint
from deltaserve.models.testing.tokenizer import EOS_TOKEN_IDS
from deltaserve.server.frontend.grammar import constraint_for
from deltaserve.server.frontend.tools import parse_tool_calls

CONFIG = EngineConfig(max_num_seqs=32, max_num_batched_tokens=256, max_prefill_chunk=64)
PROMPT = "<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n"
THINKING = PROMPT + "<think>\n"  # the generation prompt with thinking on
# Closing texts a prefix completion prefers, in order (EOS first: end as soon as allowed).
CLOSERS = ('"', "}", "]", "0", "null", "true", ": ", ", ")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(str(cached_checkpoint("tiny")))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(cached_checkpoint("tiny") / "tokenizer.json"))


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Output text without its EOS (markup tokens such as <tool_call> kept, as served)."""
    body = [t for t in ids if t not in EOS_TOKEN_IDS]
    return tokenizer.decode(body, skip_special_tokens=False)


def _complete(engine: LLMEngine, spec: Constraint, tokens: list[int], budget: int = 300) -> list:
    """A valid document that starts with `tokens`: replay them through a fresh matcher (all
    must be accepted), then close what is open with the first allowed closer."""
    compiler = engine.grammar_compiler()
    matcher = compiler.compile(spec).matcher.deep_copy()
    assert matcher.consume_tokens(tokens), matcher.get_error()
    tok = compiler.tokenizer
    closers = [tok.tokenize_str(text) for text in CLOSERS]
    closers = [ids[0] for ids in closers if len(ids) == 1]
    out = list(tokens)
    for _ in range(budget):
        allowed = set(_allowed(matcher, compiler))
        if allowed & set(EOS_TOKEN_IDS):
            return out
        token = next((t for t in closers if t in allowed), min(allowed))
        assert matcher.consume_token(token)
        out.append(token)
    raise AssertionError("no completion within the budget")


def _allowed(matcher: Any, compiler: Any) -> list[int]:
    bits = np.zeros((1, (compiler.vocab_size + 31) // 32), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return [int(t) for t in allowed_ids(bits[0], compiler.vocab_size)]


def _generate(
    loaded: LoadedModel, prompts: list[list[int]], params: list[SamplingParams], **config: Any
) -> list[Completion]:
    engine = LLMEngine(loaded, dataclasses.replace(CONFIG, **config))
    results = engine.generate(prompts, params)
    assert len(engine.constraints) == 0  # every finished choice dropped its matcher
    return results


# -- JSON schemas at temperature 1 ----------------------------------------------------------
def test_schema_corpus_at_temperature_1(loaded: LoadedModel, tokenizer: Tokenizer) -> None:
    """77 suite schemas, one row each: "stop" outputs validate, "length" outputs complete
    to valid documents, bounded schemas all stop. Prints the counts."""
    entries = [e for e in load_schemas() if e["description"] not in REFUSED]
    assert len(entries) >= 50
    specs = [Constraint("json_schema", schema=e["schema"]) for e in entries]
    bounded = [is_bounded(e["schema"]) for e in entries]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=96 if b else 48, constraint=spec)
        for i, (spec, b) in enumerate(zip(specs, bounded, strict=True))
    ]
    prompt = _ids(tokenizer, PROMPT)
    results = _generate(loaded, [prompt] * len(entries), params)
    engine = LLMEngine(loaded, CONFIG)
    counts: Counter[str] = Counter()
    for entry, spec, is_b, got in zip(entries, specs, bounded, results, strict=True):
        counts[f"{got.finish_reason} ({'bounded' if is_b else 'unbounded'})"] += 1
        tokens = [t for t in got.token_ids if t not in EOS_TOKEN_IDS]
        if got.finish_reason == "stop":
            validate(json.loads(_text(tokenizer, got.token_ids)), entry["schema"])
        else:
            assert got.finish_reason == "length" and not is_b, entry["description"]
            document = _text(tokenizer, _complete(engine, spec, tokens))
            validate(json.loads(document), entry["schema"])
    print(f"\n{len(entries)} schemas at temperature 1 on tiny: {dict(sorted(counts.items()))}")
    assert counts["stop (bounded)"] == sum(bounded) > 15


# -- forced tool calls ----------------------------------------------------------------------
def test_forced_tool_calls_name_declared_tools_with_valid_arguments(
    loaded: LoadedModel, tokenizer: Tokenizer
) -> None:
    """tool_choice "required" over all 12 BFCL tools and a named tool each, at temperature
    1: every output is tool calls only, 100% of them declared tools with valid arguments."""
    tools = _bounded_strings(load_tools())
    names = [t["function"]["name"] for t in tools]
    specs = [constraint_for(None, "required", tools) for _ in range(12)]
    specs += [constraint_for(None, "named", tools, tool_name=name) for name in names]
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=256, constraint=spec)
        for i, spec in enumerate(specs)
    ]
    results = _generate(loaded, [_ids(tokenizer, PROMPT)] * len(specs), params)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    num_calls = 0
    for spec, got in zip(specs, results, strict=True):
        assert got.finish_reason == "stop"
        content, calls = parse_tool_calls(_text(tokenizer, got.token_ids), tools)
        assert content == "" and calls and (spec.parallel_calls or len(calls) == 1)
        for call in calls:
            assert call.name in {t.name for t in spec.tools}
            validate(json.loads(call.arguments), by_name[call.name])
        num_calls += len(calls)
    print(f"\n{len(specs)} forced tool-call outputs, {num_calls} calls, all valid")


def test_reasoning_stays_free_then_the_constraint_applies(
    loaded: LoadedModel, tokenizer: Tokenizer
) -> None:
    """Thinking on: before `</think>` the row samples exactly as an unconstrained one (same
    seed, same tokens); once `</think>` is sampled (biased here) the output is JSON."""
    prompt = _ids(tokenizer, THINKING)
    spec = constraint_for({"type": "json_object"}, None, None, reasoning_end_id=THINK_CLOSE_ID)
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=12)
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=12, constraint=spec)
    forced_end = SamplingParams(
        temperature=1.0, seed=5, max_tokens=40, constraint=spec, logit_bias={THINK_CLOSE_ID: 100}
    )
    a, b, c = _generate(loaded, [prompt] * 3, [free, constrained, forced_end])
    assert THINK_CLOSE_ID not in a.token_ids and a.token_ids == b.token_ids
    assert c.token_ids[0] == THINK_CLOSE_ID
    if c.finish_reason == "stop":
        assert isinstance(json.loads(_text(tokenizer, c.token_ids[1:])), dict)
    else:
        _complete(LLMEngine(loaded, CONFIG), Constraint("json_object"), c.token_ids[1:])


def test_a_thinking_budget_closes_into_the_grammar(
    loaded: LoadedModel, tokenizer: Tokenizer
) -> None:
    """Thinking on, a 3-token budget, `</think>` biased away: after the 3 free tokens the
    engine forces "\n</think>" and stops there (the grammar owns what follows): JSON."""
    prompt = _ids(tokenizer, THINKING)
    spec = constraint_for({"type": "json_object"}, None, None, reasoning_end_id=THINK_CLOSE_ID)
    close = tuple(_ids(tokenizer, "\n</think>\n\n"))
    assert close[1] == THINK_CLOSE_ID
    never = {THINK_CLOSE_ID: -100.0}
    budget = {"max_thinking_tokens": 3, "thinking_close_ids": close, "thinking_end_id": close[1]}
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=40, constraint=spec, logit_bias=never, **budget
    )
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=3, logit_bias=never)
    got, ref = _generate(loaded, [prompt] * 2, [params, free])
    assert got.token_ids[:3] == ref.token_ids and tuple(got.token_ids[3:5]) == close[:2]
    if got.finish_reason == "stop":
        assert isinstance(json.loads(_text(tokenizer, got.token_ids[5:])), dict)
    else:
        _complete(LLMEngine(loaded, CONFIG), Constraint("json_object"), got.token_ids[5:])


# -- batched == alone -----------------------------------------------------------------------
def _mixed_batch(tokenizer: Tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    tools = _bounded_strings(load_tools())
    schemas = [e["schema"] for e in load_schemas() if is_bounded(e["schema"])][:5]
    specs: list[Constraint | None] = [Constraint("json_schema", schema=s) for s in schemas]
    specs += [constraint_for(None, "required", tools), None, None, Constraint("json_object")]
    specs += [constraint_for(None, "named", tools, tool_name="math_gcd"), None]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, constraint=spec, ignore_eos=spec is None)
        for spec in specs
    ]
    prompts = [_ids(tokenizer, PROMPT + "x" * (i % 4)) for i in range(len(specs))]
    return prompts, params


def test_mixed_constrained_and_free_rows_batched_equals_alone(
    loaded: LoadedModel, tokenizer: Tokenizer
) -> None:
    """Greedy, token-exact: each row of a batch mixing JSON, tool-call and free rows gets
    what it gets alone; so does a run without pipelined steps, and one whose decode rows'
    tokens are drawn under their masks ahead of the prompt chunks beside them (a GPU's
    compiled decode batch with publish_decode_first; small chunks, so prompts run beside
    decoding rows)."""
    prompts, params = _mixed_batch(tokenizer)
    batched = _generate(loaded, prompts, params)
    unpipelined = _generate(loaded, prompts, params, pipeline_steps=False)
    gpu = {"compile_decode": True, "publish_decode_first": True, "max_prefill_chunk": 16}
    first = _generate(loaded, prompts, params, max_num_batched_tokens=40, **gpu)
    for prompt, p, got, flat, early in zip(
        prompts, params, batched, unpipelined, first, strict=True
    ):
        alone = _generate(loaded, [prompt], [p])[0]
        assert got.token_ids == alone.token_ids == flat.token_ids == early.token_ids
        assert got.finish_reason == alone.finish_reason
    assert any(
        p.constraint is not None and r.finish_reason == "stop"
        for p, r in zip(params, batched, strict=True)
    )


def test_forks_each_follow_the_grammar(loaded: LoadedModel, tokenizer: Tokenizer) -> None:
    """n > 1: each choice has its own matcher; greedy forks equal the request alone,
    seeded forks at temperature 1 differ and are each valid."""
    prompt = _ids(tokenizer, PROMPT)
    schema = next(
        e["schema"] for e in load_schemas() if e["description"] == "simple enum validation"
    )
    spec = Constraint("json_schema", schema=schema)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, constraint=spec)
    engine = LLMEngine(loaded, CONFIG)
    engine.add_request(GenerationRequest("forks", tuple(prompt), greedy, n=3))
    choices: dict[int, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            choices.setdefault(delta.index, []).extend(delta.token_ids)
    alone = _generate(loaded, [prompt], [greedy])[0].token_ids
    assert all(tokens == alone for tokens in choices.values()) and len(choices) == 3
    sampled = SamplingParams(temperature=1.0, seed=9, max_tokens=16, constraint=spec)
    engine.add_request(GenerationRequest("seeded", tuple(prompt), sampled, n=4))
    outputs: dict[int, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            outputs.setdefault(delta.index, []).extend(delta.token_ids)
    for tokens in outputs.values():
        validate(json.loads(_text(tokenizer, tokens)), schema)
    assert len(engine.constraints) == 0


# -- refusals and lifetimes -----------------------------------------------------------------
def test_uncompilable_schema_is_an_invalid_request(
    loaded: LoadedModel, tokenizer: Tokenizer
) -> None:
    """A schema the engine cannot compile is refused at add_request, naming the problem;
    nothing is queued or kept and the engine serves the next request."""
    engine = LLMEngine(loaded, CONFIG)
    bad = Constraint("json_schema", schema={"type": "object", "dependentSchemas": {"a": {}}})
    prompt = tuple(_ids(tokenizer, PROMPT))
    with pytest.raises(InvalidRequestError, match="dependentSchemas") as info:
        engine.add_request(GenerationRequest("bad", prompt, SamplingParams(constraint=bad)))
    assert info.value.param == "constraint"
    assert not engine.has_work() and len(engine.constraints) == 0
    good = SamplingParams(temperature=0.0, max_tokens=8, constraint=Constraint("json_object"))
    assert engine.generate([list(prompt)], good)[0].token_ids


def test_abort_drops_the_matchers(loaded: LoadedModel, tokenizer: Tokenizer) -> None:
    engine = LLMEngine(loaded, CONFIG)
    params = SamplingParams(temperature=1.0, max_tokens=64, constraint=Constraint("json_object"))
    engine.add_request(GenerationRequest("a", tuple(_ids(tokenizer, PROMPT)), params, n=2))
    for _ in range(3):
        engine.step()
    assert len(engine.constraints) == 2
    engine.abort("a")
    assert len(engine.constraints) == 0
    while engine.has_work():
        engine.step()
