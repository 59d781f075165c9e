"""The scheduler-runner contract (engine/plan.py): the runner runs plans built by hand, with
no scheduler and no Request, and the scheduler's plans carry each row's inputs once.

The runner half uses the peaked tiny checkpoint (greedy ties cannot flip on float noise)
and compares against the engine's own outputs for the same prompts.
"""

from __future__ import annotations

import pytest
from plan_utils import sampled

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.budget import MemoryBudget, StateCosts
from deltaserve.engine.cache.factory import kv_store_factory
from deltaserve.engine.cache.rows import RowStates
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.plan import NewRow, PrefillChunk, StepPlan
from deltaserve.engine.runner import ModelRunner
from deltaserve.engine.sampling.sampler import Sampler
from deltaserve.engine.scheduling.scheduler import Scheduler
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.testing import cached_checkpoint

CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [(5, 17, 300, 2000, 41, 9), (7, 8, 900)]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(str(cached_checkpoint("tiny")))


@pytest.fixture(scope="module")
def expected(loaded: LoadedModel) -> list[list[int]]:
    """Greedy tokens of PROMPTS from the whole engine (it also starts the platform)."""
    results = LLMEngine(loaded, CONFIG).generate(PROMPTS, GREEDY)
    return [r.token_ids for r in results]


def _runner(loaded: LoadedModel) -> ModelRunner:
    """A runner with its own row states: no scheduler, no engine."""
    cfg, factory = loaded.config, kv_store_factory(CONFIG.kv_cache)
    states = RowStates(lambda: BatchState.empty(cfg, factory))
    return ModelRunner(loaded.model, states, Sampler(lazy_tokens=False))


def _prefill_plan(step: int = 0) -> StepPlan:
    """Both prompts in one step, each sampling its first token."""
    rows = tuple(NewRow(f"r{i}/0", p, GREEDY, 0) for i, p in enumerate(PROMPTS))
    chunks = tuple(PrefillChunk(r.row_id, 0, len(r.prompt_ids), (r.row_id,)) for r in rows)
    return StepPlan(step, new_rows=rows, prefill=chunks, num_tokens=sum(map(len, PROMPTS)))


def _decode_plan(step: int, tokens: tuple[int, ...], sources: tuple[int, ...]) -> StepPlan:
    """Both rows decode the step-th generated token (-1 inputs: from `sources`)."""
    positions = tuple(len(p) + step - 1 for p in PROMPTS)
    return StepPlan(
        step,
        decode_row_ids=("r0/0", "r1/0"),
        decode_token_ids=tokens,
        decode_sources=sources,
        decode_positions=positions,
        num_tokens=2,
    )


def test_a_runner_runs_hand_built_plans_like_the_engine(
    loaded: LoadedModel, expected: list[list[int]]
) -> None:
    """Plans with each row's prompt once, then rows by id, give the engine's tokens; the
    result names its rows and the worker keeps their tokens."""
    runner = _runner(loaded)
    result = runner.read_back(runner.sample(runner.execute(_prefill_plan())))
    assert result.row_ids == ("r0/0", "r1/0")
    got = [[t] for t in result.token_ids]
    for step in range(1, GREEDY.max_tokens):
        plan = _decode_plan(step, tuple(g[-1] for g in got), (-1, -1))
        result = runner.read_back(runner.sample(runner.execute(plan)))
        assert result.step == step and len(result.logprobs) == 2
        for g, token in zip(got, result.token_ids, strict=True):
            g.append(token)
    assert got == expected
    assert runner.rows.output_ids == {"r0/0": got[0], "r1/0": got[1]}


def test_pending_decode_inputs_come_from_the_last_sampled_step(
    loaded: LoadedModel, expected: list[list[int]]
) -> None:
    """Pipelined: a decode plan built before the previous step was read back takes its
    inputs from that step's lazy tokens (decode_sources)."""
    runner = _runner(loaded)
    previous = runner.sample(runner.execute(_prefill_plan()))
    got: list[list[int]] = [[], []]
    for step in range(1, GREEDY.max_tokens):
        output = runner.execute(_decode_plan(step, (-1, -1), (0, 1)))
        for g, token in zip(got, runner.read_back(previous).token_ids, strict=True):
            g.append(token)
        previous = runner.sample(output)
    for g, token in zip(got, runner.read_back(previous).token_ids, strict=True):
        g.append(token)
    assert got == expected


def test_freed_rows_leave_the_worker(loaded: LoadedModel) -> None:
    """A plan's freed rows lose their prompt, tokens and state; the others keep theirs."""
    runner = _runner(loaded)
    runner.read_back(runner.sample(runner.execute(_prefill_plan())))
    runner.execute(StepPlan(1, freed_row_ids=("r0/0",)))
    assert set(runner.rows.rows) == set(runner.rows.output_ids) == {"r1/0"}
    assert set(runner.states.prefill) == {"r1/0"}


# -- the scheduler's side: no model ----------------------------------------------------------
def _scheduler() -> Scheduler:
    budget = MemoryBudget(10**9, StateCosts(kv_bytes_per_token=10, ssm_bytes_per_row=100))
    return Scheduler(CONFIG, budget, max_context=4096)


def test_a_rows_inputs_come_once_and_again_for_a_new_row_of_the_same_id() -> None:
    """new_rows holds each admitted row (n > 1 choices together) in exactly one plan; a
    later request reusing a finished request's id is a new row and comes again."""
    s = _scheduler()
    s.add(GenerationRequest("a", (1, 2, 3), GREEDY, 2), frozenset())
    first = s.schedule()
    assert [(r.row_id, r.prompt_ids, r.index) for r in first.new_rows] == [
        ("a/0", (1, 2, 3), 0),
        ("a/1", (1, 2, 3), 1),
    ]
    plans = [first]
    while s.has_work():
        s.update(plans[-1], sampled(plans[-1]))
        plans.append(s.schedule())
    assert all(not p.new_rows for p in plans[1:])
    s.add(GenerationRequest("a", (4, 5), GREEDY), frozenset())
    again = s.schedule()
    assert [(r.row_id, r.prompt_ids) for r in again.new_rows] == [("a/0", (4, 5))]


def test_finish_abort_and_fail_all_release_each_row_through_the_table() -> None:
    """Every way a choice ends runs the row table's release hook once per choice (a
    waiting one's too), gives its budget share back, and frees a held row on the workers."""
    released: list[str] = []
    budget = MemoryBudget(10**9, StateCosts(kv_bytes_per_token=10, ssm_bytes_per_row=100))
    s = Scheduler(CONFIG, budget, max_context=4096, on_release=(released.extend,))
    s.add(GenerationRequest("a", (1, 2, 3), GREEDY, 2), frozenset())
    s.add(GenerationRequest("b", (4, 5), SamplingParams(max_tokens=1)), frozenset())
    plan = s.schedule()
    s.update(plan, sampled(plan))  # b finishes on its first token
    assert released == ["b/0"] and s.schedule().freed_row_ids == ("b/0",)
    s.abort("a")
    assert sorted(released) == ["a/0", "a/1", "b/0"] and budget.reserved == 0
    assert set(s.schedule().freed_row_ids) == {"a/0", "a/1"}
    released.clear()
    s.add(GenerationRequest("c", (1, 2), GREEDY), frozenset())
    s.schedule()
    s.add(GenerationRequest("d", (3,), GREEDY, 2), frozenset())  # still waiting
    assert [d.finish_reason for d in s.fail_all("boom")] == ["error"] * 3
    assert sorted(released) == ["c/0", "d/0", "d/1"]
    assert budget.reserved == 0 and not s.has_work() and not s.schedule().freed_row_ids
