"""Scheduler policy without a model: budgets, chunking, admission, finishing, abort."""

from __future__ import annotations

from functools import partial

import pytest
from plan_utils import sampled

from deltaserve.engine.api import QueueFullError
from deltaserve.engine.cache.budget import MemoryBudget, StateCosts, default_budget_bytes
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.plan import StepPlan
from deltaserve.engine.scheduling.scheduler import Scheduler
from deltaserve.engine.shapes import decode_bucket
from deltaserve.engine.types import GenerationRequest, InvalidRequestError, SamplingParams

EOS = frozenset({0})


def _scheduler(budget_bytes: int = 10**9, compiled_chunks: bool = False, **kw) -> Scheduler:
    cfg = EngineConfig(
        **{"max_num_seqs": 4, "max_num_batched_tokens": 16, "max_prefill_chunk": 8, **kw}
    )
    # A clock that never moves: no step time is observed, so the latency bound stays off
    # and these tests see the token budget alone (tests/test_scheduler_latency.py: the bound).
    budget = MemoryBudget(budget_bytes, StateCosts(10, 100))
    return Scheduler(
        cfg, budget, max_context=1000, clock=lambda: 0.0, compiled_chunks=compiled_chunks
    )


def _req(rid: str, prompt_len: int, max_tokens: int = 4, n: int = 1) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), n
    )


def _run(s: Scheduler, out: StepPlan, token: int = 7) -> list:
    """Pretend the forward ran: every sampling row gets `token`."""
    return s.update(out, sampled(out, token))


def test_budget_bounds_every_step_and_decode_continues() -> None:
    """A long prompt prefills in chunks while running rows decode every step."""
    s = _scheduler()
    s.add(_req("short", 3, max_tokens=50), EOS)
    _run(s, s.schedule())  # short's prompt done in one chunk
    s.add(_req("long", 100), EOS)
    steps_with_long_prefill = 0
    while s.rows.get("long/0") is None or s.rows["long/0"].is_prefilling:
        out = s.schedule()
        assert out.num_tokens <= 16
        assert "short/0" in out.decode_row_ids  # decode never stalls
        assert all(c.length <= 8 for c in out.prefill)
        steps_with_long_prefill += 1
        _run(s, out)
    assert steps_with_long_prefill == 13  # ceil(100 / 8) chunks, one per step


def test_finish_on_eos_stop_ids_and_max_tokens() -> None:
    s = _scheduler()
    s.add(_req("a", 2, max_tokens=3), EOS)
    s.add(GenerationRequest("b", (1, 2), SamplingParams(max_tokens=9, stop_token_ids=(5,))), EOS)
    out = s.schedule()
    deltas = s.update(out, sampled(out, [7, 5]))
    assert [d.finish_reason for d in deltas] == [None, "stop"]
    assert s.schedule().freed_row_ids == ("b/0",)
    # 'a' hits max_tokens after its third token
    for expected in (None, "length"):
        out = s.schedule()
        assert _run(s, out)[0].finish_reason == expected
    assert not s.rows


def test_eos_finishes_unless_ignored() -> None:
    s = _scheduler()
    s.add(GenerationRequest("x", (1,), SamplingParams(max_tokens=3, ignore_eos=True)), EOS)
    s.add(_req("y", 1), EOS)
    out = s.schedule()
    assert [d.finish_reason for d in s.update(out, sampled(out, [0, 0]))] == [None, "stop"]


def test_admission_bounded_by_rows_and_memory() -> None:
    s = _scheduler(budget_bytes=100 + 10 * 20 + 5)  # room for one row of 20 tokens
    s.add(_req("a", 6, max_tokens=14), EOS)
    s.add(_req("b", 6, max_tokens=14), EOS)
    out = s.schedule()
    assert [c.row_id for c in out.prefill] == ["a/0"]  # b waits for memory
    assert len(s.waiting) == 1
    _run(s, out, token=0)  # a finishes on EOS and releases its reservation
    out = s.schedule()
    assert [c.row_id for c in out.prefill] == ["b/0"]


def test_request_that_can_never_fit_is_rejected() -> None:
    s = _scheduler(budget_bytes=1000)
    with pytest.raises(InvalidRequestError):
        s.add(_req("big", 50, max_tokens=200), EOS)
    with pytest.raises(InvalidRequestError, match="context"):
        _scheduler().add(_req("long", 900, max_tokens=200), EOS)


def test_duplicate_request_id_rejected() -> None:
    """A second live request with the same id would share rows: refused before queueing."""
    s = _scheduler()
    s.add(_req("a", 3), EOS)
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add(_req("a", 3), EOS)
    _run(s, s.schedule())  # running now, still live
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add(_req("a", 3), EOS)


def test_queue_full() -> None:
    s = _scheduler(max_waiting=2)
    s.add(_req("a", 1), EOS)
    s.add(_req("b", 1), EOS)
    with pytest.raises(QueueFullError):
        s.add(_req("c", 1), EOS)


def test_abort_frees_row_at_next_step() -> None:
    s = _scheduler()
    s.add(_req("a", 4, max_tokens=20), EOS)
    s.add(_req("b", 30, max_tokens=20), EOS)
    _run(s, s.schedule())
    deltas = s.abort("b")
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("b", "abort")]
    out = s.schedule()
    assert out.freed_row_ids == ("b/0",) and not out.prefill
    assert s.abort("missing") == []


def test_waiting_prompts_share_the_prefill_budget() -> None:
    """Prompts behind a long one are admitted in the same step and share the budget: the
    long one takes at most half while others wait, a short one what it needs, and what
    is left goes back to the oldest; once the oldest can finish, it does (its first token
    comes first), and the next prompt takes the rest."""
    s = _scheduler(max_num_batched_tokens=64, max_prefill_chunk=64)
    s.add(_req("long", 100), EOS)
    s.add(_req("short", 3), EOS)
    out = s.schedule()
    assert [(c.row_id, c.length) for c in out.prefill] == [("long/0", 61), ("short/0", 3)]
    s.add(_req("c", 40), EOS)
    _run(s, out)
    out = s.schedule()  # short decodes now: 63 tokens for long (39 to go) and c (40)
    assert [(c.row_id, c.length) for c in out.prefill] == [("long/0", 39), ("c/0", 24)]


def test_compiled_chunks_fill_their_bucket_unless_they_finish_the_prompt() -> None:
    """With later chunks compiled (engine/shapes.py), a chunk that does not finish its
    prompt grows to the length its traced forward computes anyway, so its padding never
    becomes the row's left padding; the last chunk keeps its own length. Without, the
    same allowances give chunks of their exact size."""
    lengths = {}
    for compiled in (False, True):
        s = _scheduler(max_num_batched_tokens=200, max_prefill_chunk=256, compiled_chunks=compiled)
        s.add(_req("a", 300, max_tokens=1), EOS)
        chunks: list[int] = []
        while sum(chunks) < 300:
            out = s.schedule()
            chunks += [c.length for c in out.prefill]
            _run(s, out)
        lengths[compiled] = chunks
    assert lengths[False] == [200, 100]
    assert lengths[True] == [256, 44]  # 200 -> its bucket (256); the last one as it is


def test_compiled_chunks_reserve_their_kv_capacity_while_prefilling() -> None:
    """A prefilling row whose later chunks run compiled holds a KV capacity bucket
    (engine/shapes.py's prefill_columns: 600 prompt tokens -> 1,024 columns) beyond its
    own reservation (prompt + max_tokens = 604): admission counts it, and it is given
    back when the prefill ends; the row's own share stays."""
    per_row = 100 + 10 * 604
    for compiled, held in ((False, per_row), (True, per_row + 10 * (1024 - 604))):
        s = _scheduler(max_num_batched_tokens=512, max_prefill_chunk=512, compiled_chunks=compiled)
        s.add(_req("a", 600), EOS)
        _run(s, s.schedule())
        assert s.budget.reserved == held
        while s.rows["a/0"].is_prefilling:
            _run(s, s.schedule())
        _run(s, s.schedule())  # the row decodes: its prefill has ended
        assert s.rows["a/0"].num_computed > 600
        assert s.budget.reserved == per_row
    # room for two such rows, not for two buckets: the second waits for the first's prefill
    for compiled, admitted in ((False, ["a/0", "b/0"]), (True, ["a/0"])):
        s = _scheduler(2 * per_row + 1000, max_num_batched_tokens=1024, max_prefill_chunk=512,
                       compiled_chunks=compiled)  # fmt: skip
        s.add(_req("a", 600), EOS)
        s.add(_req("b", 600), EOS)
        assert [c.row_id for c in s.schedule().prefill] == admitted
    with pytest.raises(InvalidRequestError, match="memory budget"):  # never fits: refused
        _scheduler(per_row + 1000, compiled_chunks=True).add(_req("c", 600), EOS)


def test_n_choices_fork_after_one_prefill() -> None:
    s = _scheduler()
    s.add(_req("p", 5, max_tokens=2, n=3), EOS)
    out = s.schedule()
    assert len(out.prefill) == 1  # one prefill for all three choices
    assert out.prefill[0].sample_row_ids == ("p/0", "p/1", "p/2")
    deltas = _run(s, out)
    assert sorted(d.index for d in deltas) == [0, 1, 2]
    out = s.schedule()
    assert out.forks == (("p/1", "p/0"), ("p/2", "p/0"))
    assert out.decode_row_ids == ("p/0", "p/1", "p/2")


def test_padding_counts_a_held_batchs_dead_rows() -> None:
    """With the compiled decode step the batch is held at a bucket size: 3 rows run as 4,
    the dead one with the longest row's KV columns and its own DeltaNet state, which the
    budget's padding counts (and admission with it)."""
    costs = StateCosts(10, 100, 5)
    plain = MemoryBudget(10**6, costs)
    held = MemoryBudget(10**6, costs, partial(decode_bucket, max_rows=64))
    lengths = [100, 40, 60]
    assert plain.padding_bytes(lengths) == (3 * 100 - 200) * 10
    assert held.padding_bytes(lengths) == (4 * 100 - 200) * 10 + (100 + 5)
    assert held.padding_bytes([100, 40]) == plain.padding_bytes([100, 40])  # 2: a bucket
    # a budget with room for three rows and their padding, not for a fourth's dead row
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=64)
    room = 3 * (100 + 10 * 12) + (3 * 12 - 36) * 10 + 50
    for rows_held, admitted in ((None, 3), (partial(decode_bucket, max_rows=64), 2)):
        s = Scheduler(cfg, MemoryBudget(room, StateCosts(10, 100), rows_held), 1000, lambda: 0.0)
        for name in "abc":
            s.add(_req(name, 8), EOS)
        assert len(s.schedule().prefill) == admitted


GIB = 2**30


@pytest.mark.parametrize(
    ("info", "on_cpu", "expected"),
    [
        # CUDA (mlx-cuda 0.32): total_memory / free_memory, measured after the weights loaded
        ({"total_memory": 140 * GIB, "free_memory": 120 * GIB}, False, 60 * GIB),
        # Metal: the recommended working set, minus the weights
        (
            {"memory_size": 64 * GIB, "max_recommended_working_set_size": 48 * GIB},
            False,
            (48 - 2) * GIB // 2,
        ),
        ({"memory_size": 64 * GIB}, False, (64 - 2) * GIB // 2),  # older Metal: all memory
        ({"device_name": "AMD EPYC"}, True, (24 - 2) * GIB // 2),  # CPU: host RAM
        ({"total_memory": 3 * GIB, "free_memory": 100 * 2**20}, False, 256 * 2**20),  # floor
    ],
)
def test_default_budget_reads_each_backend(info: dict, on_cpu: bool, expected: int) -> None:
    """The default row-state budget comes from the device's real memory on every backend
    (a budget read from Metal's key on CUDA fell to its 256 MiB floor)."""
    assert default_budget_bytes(info, 24 * GIB, 2 * GIB, on_cpu) == expected
