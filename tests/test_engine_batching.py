"""Batched == alone: a request's output never depends on which rows share its batch.

Runs the real engine on the peaked tiny checkpoints (greedy ties cannot flip on float
noise there), so token-exact comparisons are meaningful.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Hashable

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Completion, LLMEngine
from deltaserve.engine.plan import StepPlan
from deltaserve.engine.types import GenerationRequest, RequestOutput, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.testing import cached_checkpoint

# Logprobs of the same token batched vs alone: float32 reductions in a different batch
# shape reorder sums; 1e-3 nats is far below any decision the sampler makes.
LOGPROB_ATOL = 1e-3
SMALL = EngineConfig(max_num_seqs=16, max_num_batched_tokens=48, max_prefill_chunk=24)


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([1, 3, 17, 40, 70]) for _ in range(count)]
    return [[rng.randrange(100, 240000) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _alone(loaded: LoadedModel, prompt: list[int], params: SamplingParams) -> Completion:
    return LLMEngine(loaded, SMALL).generate([prompt], params)[0]


def _drive(
    engine: LLMEngine,
    joins: dict[int, list[GenerationRequest]],
    aborts=None,
    key: Callable[[RequestOutput], Hashable] = lambda delta: delta.request_id,
) -> dict:
    """Step the engine, adding requests at given steps; returns tokens per request id
    (or per `key` of each delta)."""
    tokens: dict[Hashable, list[int]] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in joins):
        for req in joins.get(step, []):
            engine.add_request(req)
        for request_id in (aborts or {}).get(step, []):
            engine.abort(request_id)
        for delta in engine.step():
            tokens.setdefault(key(delta), []).extend(delta.token_ids)
        step += 1
    return tokens


def test_batch_of_16_mixed_lengths_equals_alone(loaded: LoadedModel) -> None:
    """16 prompts of lengths 1..70 (longer than the 24-token chunk) batched == alone."""
    prompts = _prompts(16)
    params = [_greedy(max_tokens=4 + i % 5, logprobs=True) for i in range(16)]  # early finishes
    batched = LLMEngine(loaded, SMALL).generate(prompts, params)
    for prompt, p, got in zip(prompts, params, batched, strict=True):
        ref = _alone(loaded, prompt, p)
        assert got.token_ids == ref.token_ids
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < LOGPROB_ATOL


def test_late_joins_and_aborts(loaded: LoadedModel) -> None:
    """Rows joining while others decode, and aborted neighbours, change nobody's tokens."""
    prompts = _prompts(6, seed=1)
    reqs = [GenerationRequest(f"r{i}", tuple(p), _greedy(12)) for i, p in enumerate(prompts)]
    joins = {0: reqs[:2], 3: reqs[2:4], 7: reqs[4:]}
    tokens = _drive(LLMEngine(loaded, SMALL), joins, aborts={5: ["r1"], 9: ["r4"]})
    for i, prompt in enumerate(prompts):
        ref = _alone(loaded, prompt, _greedy(12)).token_ids
        got = tokens.get(f"r{i}", [])
        if i in (1, 4):
            assert got == ref[: len(got)] and len(got) < 12  # cut short, same prefix
        else:
            assert got == ref


def test_mixed_sampling_params_share_a_batch(loaded: LoadedModel) -> None:
    """Greedy, seeded-sampled and penalised rows in one batch each equal their solo run."""
    prompts = _prompts(5, seed=2)
    params = [
        _greedy(8),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=11, max_tokens=8, ignore_eos=True),
        _greedy(8, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=8, ignore_eos=True),
    ]
    batched = LLMEngine(loaded, SMALL).generate(prompts, params)
    for prompt, p, got in zip(prompts, params, batched, strict=True):
        assert got.token_ids == _alone(loaded, prompt, p).token_ids


def test_seeded_sampling_reproducible_across_compositions(loaded: LoadedModel) -> None:
    """A seeded request samples the same tokens whatever else runs and in which row."""
    target = _prompts(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = _alone(loaded, target, params).token_ids
    others = _prompts(4, seed=4)
    first = LLMEngine(loaded, SMALL).generate([target, *others], [params] + [_greedy()] * 4)
    last = LLMEngine(loaded, SMALL).generate([*others, target], [_greedy()] * 4 + [params])
    assert first[0].token_ids == alone == last[-1].token_ids


def test_n_choices_share_prefill(loaded: LoadedModel) -> None:
    """n greedy choices forked from one prefill are identical to the request alone."""
    prompt = _prompts(1, seed=5)[0]
    engine = LLMEngine(loaded, SMALL)
    engine.add_request(GenerationRequest("n", tuple(prompt), _greedy(6), n=3))
    choices: dict[int, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            choices.setdefault(delta.index, []).extend(delta.token_ids)
    ref = _alone(loaded, prompt, _greedy(6)).token_ids
    assert choices == {0: ref, 1: ref, 2: ref}


def test_long_prompt_never_stalls_decode(loaded: LoadedModel) -> None:
    """While a long prompt prefills chunk by chunk, running rows get a token every step."""
    engine = LLMEngine(loaded, SMALL)
    engine.add_request(GenerationRequest("short", (5, 6, 7), _greedy(40)))
    engine.step()
    engine.add_request(GenerationRequest("long", tuple(range(1000, 1200)), _greedy(2)))
    steps = 0
    while "long/0" not in engine.scheduler.rows or engine.scheduler.rows["long/0"].is_prefilling:
        deltas = engine.step()
        assert any(d.request_id == "short" and d.token_ids for d in deltas)
        steps += 1
    assert steps >= 200 // SMALL.max_num_batched_tokens


def test_prompt_work_next_to_decode_rows_runs_in_lockstep(loaded: LoadedModel) -> None:
    """A pipelined engine reads back a step that prefills next to decoding rows before
    planning the next (its measured time is its own: the stall bound is sized from it),
    and one that samples a prompt's first token; decode-only steps and prompt chunks
    alone that sample nothing stay pipelined."""
    engine = LLMEngine(loaded, dataclasses.replace(SMALL, pipeline_steps=True))
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording
    engine.add_request(GenerationRequest("short", (5, 6, 7), _greedy(30)))
    kinds = set()
    for step in range(24):
        if step == 4:
            engine.add_request(GenerationRequest("long", tuple(range(1000, 1100)), _greedy(2)))
        engine.step()
        plan = plans[-1]
        first = any(c.sample_row_ids for c in plan.prefill)
        lockstep = bool(plan.prefill) and (bool(plan.decode_row_ids) or first)
        assert (engine._inflight is None) == lockstep or plan.is_empty, step
        kinds.add(lockstep)
    assert kinds == {True, False}


PIPELINED = dataclasses.replace(SMALL, pipeline_steps=True)


def _with_publish(
    loaded: LoadedModel, hook: bool, config: EngineConfig = PIPELINED
) -> tuple[dict, list[tuple[str, bool]]]:
    """A short request decoding pipelined, a longer prompt joining at step 4; each
    request's tokens, and the order of publish calls (whether only the decode row's
    deltas), forwards (whether a prompt chunk beside decode rows) and each step's
    return (whether it held the decode row's deltas)."""
    engine = LLMEngine(loaded, config)
    events: list[tuple[str, bool]] = []
    deltas: list[RequestOutput] = []
    execute = engine.runner.execute

    def recording(plan: StepPlan) -> object:
        events.append(("execute", bool(plan.prefill) and bool(plan.decode_row_ids)))
        return execute(plan)

    def publish(early: list[RequestOutput]) -> None:
        events.append(("publish", all(d.request_id == "short" for d in early)))
        deltas.extend(early)

    engine.runner.execute = recording
    engine.add_request(GenerationRequest("short", (5, 6, 7), _greedy(30)))
    for step in range(40):
        if step == 4:
            engine.add_request(GenerationRequest("long", tuple(range(1000, 1060)), _greedy(4)))
        returned = engine.step(publish if hook else None)
        events.append(("return", any(d.request_id == "short" for d in returned)))
        deltas.extend(returned)
    tokens = {
        r: [t for d in deltas if d.request_id == r for t in d.token_ids] for r in ("short", "long")
    }
    return tokens, events


def test_a_lockstep_step_publishes_the_step_in_flight_before_its_forward(
    loaded: LoadedModel,
) -> None:
    """A prompt chunk beside pipelined decode rows runs in lockstep: the decode step
    still in flight is read back first, and with `publish` its tokens are handed over
    then, before the chunk's forward is built (a stream's gap is not both steps); the
    tokens are those of a run that returns them with the step's own."""
    tokens, events = _with_publish(loaded, hook=True)
    published = [i for i, e in enumerate(events) if e[0] == "publish"]
    assert published, "no lockstep step came after a pipelined one"
    for i in published:  # the decode row's tokens, then the mixed step's forward
        assert events[i] == ("publish", True) and events[i + 1] == ("execute", True)
    returned, events = _with_publish(loaded, hook=False)
    assert not any(e[0] == "publish" for e in events)
    assert tokens == returned and len(tokens["short"]) == 30 and len(tokens["long"]) == 4


def test_a_mixed_step_publishes_its_decode_rows_before_its_prompt_forward_ends(
    loaded: LoadedModel,
) -> None:
    """publish_decode_first (a switch, off by default) with the compiled decode batch: in a
    step with a prompt chunk beside decode rows, the rows' own tokens are drawn ahead of the
    prompt forward and handed to `publish` once it is queued, not returned with the
    step (a stream's gap is the decode part, not the whole lockstep step); the tokens
    are those of the same engine without it."""
    on = dataclasses.replace(PIPELINED, compile_decode=True, publish_decode_first=True)
    tokens, events = _with_publish(loaded, True, on)
    mixed = [i for i, e in enumerate(events) if e == ("execute", True)]
    assert len(mixed) >= 2, "the prompt ran beside the decode row"
    for i in mixed:  # the step's own decode token published, the step returns without it
        assert events[i + 1 : i + 3] == [("publish", True), ("return", False)], events[i:]
    off, events = _with_publish(loaded, True, dataclasses.replace(on, publish_decode_first=False))
    mixed = [i for i, e in enumerate(events) if e == ("execute", True)]
    assert mixed and all(events[i + 1] == ("return", True) for i in mixed)  # at the end
    returned, _ = _with_publish(loaded, False, on)  # without `publish`: returned with the step
    assert tokens == off == returned and len(tokens["short"]) == 30 and len(tokens["long"]) == 4


def test_first_token_comes_back_from_the_step_that_computed_it(loaded: LoadedModel) -> None:
    """With nothing else running, a prompt's first token is returned by the step of its
    final chunk (not one step later), and a max_tokens=1 request then computes nothing
    more (the next step only frees its row)."""
    engine = LLMEngine(loaded, dataclasses.replace(SMALL, pipeline_steps=True))
    engine.add_request(GenerationRequest("one", (5, 6, 7, 8), _greedy(1)))
    deltas = engine.step()
    assert len(deltas) == 1 and len(deltas[0].token_ids) == 1
    assert deltas[0].finish_reason == "length"
    after = engine.scheduler.schedule()
    assert after.is_empty and after.freed_row_ids == ("one/0",)


def test_failing_every_request_survives_broken_accounting(loaded: LoadedModel) -> None:
    """After a step raised, every running and queued request ends with the error even if
    the memory accounting was left inconsistent (ending them must not raise again: their
    streams would wait forever), and nothing stays reserved; with MLX's cache emptied
    after, a new request runs."""
    engine = LLMEngine(loaded, SMALL)
    for i, p in enumerate(_prompts(4, seed=3)):
        engine.add_request(GenerationRequest(f"r{i}", tuple(p), _greedy(20)))
    engine.step()
    engine.step()
    engine.budget.reserved //= 3  # as if a release had been counted twice
    deltas = engine.fail_all("engine error: boom")
    assert sorted(d.request_id for d in deltas) == [f"r{i}" for i in range(4)]
    assert all(d.finish_reason == "error" for d in deltas)
    assert engine.budget.reserved == 0 and not engine.has_work()
    engine.release_cached_buffers()  # as the engine loop does next (MLX's cache emptied)
    engine.add_request(GenerationRequest("after", (5, 6, 7), _greedy(2)))
    tokens = [t for _ in range(4) for d in engine.step() for t in d.token_ids]
    assert len(tokens) == 2 and not engine.has_work()


def test_pipelined_steps_equal_lockstep(loaded: LoadedModel) -> None:
    """Planning step N+1 before reading step N back changes no token (greedy, seeded,
    penalised rows; joins and aborts), only when tokens become visible."""
    prompts = _prompts(6, seed=8)
    params = [
        _greedy(9),
        SamplingParams(temperature=0.9, seed=5, max_tokens=7, ignore_eos=True),
        _greedy(3, repetition_penalty=1.5, frequency_penalty=0.4),
    ] * 2
    reqs = [GenerationRequest(f"r{i}", tuple(p), params[i]) for i, p in enumerate(prompts)]
    joins = {0: reqs[:3], 4: reqs[3:]}
    runs = []
    for pipeline in (True, False):
        config = dataclasses.replace(SMALL, pipeline_steps=pipeline)
        runs.append(_drive(LLMEngine(loaded, config), joins, aborts={6: ["r4"]}))
    pipelined, lockstep = runs
    aborted = pipelined.pop("r4", []), lockstep.pop("r4", [])
    assert pipelined == lockstep
    # The abort lands at the same step, when the pipelined engine has shown one token less.
    assert aborted[0] == aborted[1][: len(aborted[0])]


def test_debug_log_says_where_each_steps_host_time_went(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """With debug logging, every step that ran says its host time by part, its wait on
    the device and MLX's memory after it (what a slow step in a server's log is read by)."""
    engine = LLMEngine(loaded, SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with caplog.at_level("DEBUG", logger="deltaserve.engine.engine"):
        engine.generate([[5, 6, 7], list(range(10, 40))], params)
    lines = [r.getMessage() for r in caplog.records if " host " in r.getMessage()]
    steps = [int(line.split()[1]) for line in lines]
    assert steps and steps == sorted(set(steps))
    assert len(steps) >= 4  # the prompts' step and each decode step
    for line in lines:
        assert "(schedule / build / submit / sample / update:" in line, line
        assert "waited" in line and "MLX active" in line and "cache" in line, line
