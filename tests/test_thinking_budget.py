"""The thinking budget: after max_thinking_tokens the engine forces "\\n</think>\\n\\n".

Engine-level on the tiny random checkpoint, whose weights rarely write `</think>` by
themselves (here a -100 logit_bias makes sure they never do, while the forced close still
comes: forcing replaces the draw). Request.forced_token is checked alone first.
"""

from __future__ import annotations

import dataclasses

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.request import Request
from deltaserve.engine.structured.spec import Constraint
from deltaserve.engine.types import GenerationRequest, InvalidRequestError, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.chat_format import THINK_CLOSE_ID
from deltaserve.models.testing import cached_checkpoint

CLOSE = (198, THINK_CLOSE_ID, 271)  # "\n", "</think>", "\n\n" in the Qwen3.5 tokenizer
SMALL = EngineConfig(max_num_seqs=16, max_num_batched_tokens=48, max_prefill_chunk=24)
NEVER_CLOSE = {THINK_CLOSE_ID: -100.0}  # the model never closes its thinking by itself
PROMPT = [5, 70, 900, 1234, 77, 3000]


def _budget(budget: int | None, **kw) -> SamplingParams:
    fields = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw}
    if budget is None:
        return SamplingParams(**fields)
    return SamplingParams(
        **fields, max_thinking_tokens=budget, thinking_close_ids=CLOSE, thinking_end_id=CLOSE[1]
    )


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(str(cached_checkpoint("tiny")))


def _forced_after(params: SamplingParams, output: list[int]) -> int | None:
    req = Request("r", 0, [1, 2], params, frozenset(), 100, output_ids=output)
    return req.forced_token()


def test_forced_token_follows_the_budget_and_the_close() -> None:
    """Free before the budget, then the close one token a step, then free again; nothing
    when the model closed within the budget or the budget is unset."""
    p = _budget(3)
    assert [_forced_after(p, [9] * k) for k in range(7)] == [None] * 3 + [*CLOSE, None]
    assert _forced_after(p, [9, THINK_CLOSE_ID, 9]) is None  # closed by itself
    assert _forced_after(_budget(0), []) == CLOSE[0]
    assert _forced_after(_budget(None), [9] * 3) is None


def test_a_constrained_row_is_forced_up_to_the_end_token_only() -> None:
    """A grammar that starts after `</think>` owns every later token, so the forced close
    stops there; a grammar that would cover the thinking is refused with the budget."""
    spec = Constraint("json_object", start_after_token_id=THINK_CLOSE_ID)
    p = _budget(2, ignore_eos=False, constraint=spec)
    assert [_forced_after(p, [9] * k) for k in range(2, 5)] == [CLOSE[0], CLOSE[1], None]
    with pytest.raises(InvalidRequestError, match="start after") as err:
        _budget(2, ignore_eos=False, constraint=Constraint("json_object"))
    assert err.value.param == "max_thinking_tokens"
    with pytest.raises(InvalidRequestError, match="close ids"):
        SamplingParams(max_thinking_tokens=4, thinking_close_ids=(1, 2), thinking_end_id=3)


@pytest.mark.parametrize("pipeline", [True, False])
def test_budget_row_closes_and_answers_next_to_an_unaffected_row(
    loaded: LoadedModel, pipeline: bool
) -> None:
    """Budget 5: exactly 5 free tokens (the unbudgeted run's), the forced close with the
    model's own logprobs, then an answer; a row without a budget in the same batch is
    token-identical to running alone. Pipelined steps or lockstep."""
    config = dataclasses.replace(SMALL, pipeline_steps=pipeline)
    other = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    budget = _budget(5, logit_bias=NEVER_CLOSE, logprobs=True, top_logprobs=2)
    free = _budget(None, logit_bias=NEVER_CLOSE, logprobs=True, top_logprobs=2)
    engine = LLMEngine(loaded, config)
    got, neighbour = engine.generate([PROMPT, other], [budget, _budget(None, max_tokens=16)])
    alone_free = LLMEngine(loaded, config).generate([PROMPT], free)[0]
    alone_other = LLMEngine(loaded, config).generate([other], _budget(None, max_tokens=16))[0]
    assert THINK_CLOSE_ID not in alone_free.token_ids
    assert got.token_ids[:5] == alone_free.token_ids[:5]
    assert tuple(got.token_ids[5:8]) == CLOSE
    assert len(got.token_ids) == 12 and got.finish_reason == "length"  # 4 answer tokens
    assert neighbour.token_ids == alone_other.token_ids
    forced = got.logprobs[5:8]
    assert [lp.token_id for lp in forced] == list(CLOSE)
    assert forced[1].logprob < -50  # the biased `</think>`: what the model gave it
    assert all(len(lp.top) == 2 for lp in forced)


def test_each_choice_counts_its_own_thinking(loaded: LoadedModel) -> None:
    """n = 3, seeded at temperature 1: the choices think differently and each is closed
    after exactly its own 4 thinking tokens."""
    params = _budget(4, temperature=1.0, seed=3, logit_bias=NEVER_CLOSE)
    engine = LLMEngine(loaded, SMALL)
    engine.add_request(GenerationRequest("n", tuple(PROMPT), params, n=3))
    choices: dict[int, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            choices.setdefault(delta.index, []).extend(delta.token_ids)
    assert sorted(choices) == [0, 1, 2]
    assert all(tuple(ids[4:7]) == CLOSE and len(ids) == 12 for ids in choices.values())
    assert len({tuple(ids[:4]) for ids in choices.values()}) > 1


def test_a_row_that_closes_within_its_budget_is_not_forced(loaded: LoadedModel) -> None:
    """When `</think>` (here: a token the greedy model writes at step 2) comes within the
    budget, the output is exactly the unbudgeted run's."""
    free = LLMEngine(loaded, SMALL).generate([PROMPT], _budget(None))[0].token_ids
    end = free[2]
    assert end not in free[:2]
    close = {"thinking_close_ids": (198, end, 271), "thinking_end_id": end}
    params = dataclasses.replace(_budget(None), max_thinking_tokens=4, **close)
    assert LLMEngine(loaded, SMALL).generate([PROMPT], params)[0].token_ids == free
