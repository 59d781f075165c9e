"""Latency-bounded scheduling: a fake clock advances by a known step cost, the scheduler
learns it, and steps holding decode rows stay within max_stall_factor x decode-only."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from plan_utils import sampled

from deltaserve.engine.api import STEP_KINDS, STEP_SECONDS_BUCKETS
from deltaserve.engine.cache.budget import MemoryBudget, StateCosts
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.plan import StepPlan
from deltaserve.engine.scheduling.prefill_policy import BACKLOG_EVERY
from deltaserve.engine.scheduling.scheduler import MIN_PREFILL_TOKENS, SLOW_STEP_EVERY, Scheduler
from deltaserve.engine.scheduling.step_cost import HEADROOM, MAX_AGE, ChunkCost
from deltaserve.engine.types import GenerationRequest, ImageInput, SamplingParams
from deltaserve.engine.vision.media import PromptMedia
from deltaserve.models.build import load_model
from deltaserve.models.testing import cached_checkpoint

EOS = frozenset({0})
BUDGET = 512


@dataclass
class FakeCost:
    """The machine's true step time: base + per_row * decode rows + per_token * prefill
    + per_vision * the tower blocks' estimated token equivalents."""

    base: float = 0.010
    per_row: float = 0.001
    per_token: float = 0.00005
    per_vision: float = 0.00005
    now: float = 0.0  # the fake clock

    def __call__(self) -> float:
        return self.now

    def decode_only(self, num_decode: int) -> float:
        return self.base + self.per_row * num_decode

    def seconds(self, out: StepPlan) -> float:
        num_prefill = sum(c.length for c in out.prefill)
        num_vision = sum(c.vision_tokens for c in out.prefill)
        tower = self.per_vision * num_vision
        return self.decode_only(len(out.decode_row_ids)) + self.per_token * num_prefill + tower


def _scheduler(
    cost: FakeCost,
    snapshot_in_chunk: bool = False,
    chunk_cost: ChunkCost | None = None,
    pipelined: bool = False,
    **kw,
) -> Scheduler:
    """A scheduler on the fake machine's clock; chunk_cost: a start-up measurement (a GPU);
    pipelined: the engine's decode steps pipeline."""
    cfg = EngineConfig(
        **{"max_num_seqs": 16, "max_num_batched_tokens": BUDGET, "max_prefill_chunk": 512, **kw}
    )
    budget = MemoryBudget(10**9, StateCosts(10, 100))
    return Scheduler(
        cfg,
        budget,
        20000,
        clock=cost,
        chunk_cost=chunk_cost,
        snapshot_in_chunk=snapshot_in_chunk,
        pipelined=pipelined,
    )


def _req(rid: str, prompt_len: int, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens)
    )


def _step(s: Scheduler, cost: FakeCost) -> StepPlan:
    """One step that takes the fake machine's time (planned and updated in lockstep)."""
    out = s.schedule()
    cost.now += cost.seconds(out)
    s.update(out, sampled(out))
    return out


def _decoding(s: Scheduler, cost: FakeCost, rows: int = 4, steps: int = 5) -> None:
    """Start `rows` long-running decode rows and learn what decode-only steps cost."""
    for i in range(rows):
        s.add(_req(f"d{i}", 8, max_tokens=1000), EOS)
    for _ in range(steps):
        _step(s, cost)


def _prefill_until_done(s: Scheduler, cost: FakeCost, row_id: str) -> list[StepPlan]:
    outs = []
    while row_id not in s.rows or s.rows[row_id].is_prefilling:
        outs.append(_step(s, cost))
        assert len(outs) < 500, "prefill does not progress"
    return outs


def test_stall_bound_holds_with_decode_rows() -> None:
    """After learning, every step that prefills next to decode rows takes at most 2x a
    decode-only step, and uses most of that room (not just the minimum)."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost)
    s.add(_req("long", 3000), EOS)
    outs = _prefill_until_done(s, cost, "long/0")
    for out in outs:
        num_decode = len(out.decode_row_ids)
        assert num_decode == 4
        assert cost.seconds(out) <= 2 * cost.decode_only(num_decode) + 1e-12
    sizes = [out.num_tokens - 4 for out in outs]
    assert sizes[0] == MIN_PREFILL_TOKENS  # first one: a probe
    assert sizes[1:5] == [32, 64, 128, 238]  # slow start: twice the largest seen, per step
    room = 1 + 0.95 * HEADROOM  # sized to HEADROOM of the bound's extra time
    assert all(cost.seconds(o) >= room * cost.decode_only(4) for o in outs[5:-1])
    assert sizes[5] == 238  # then the fit: 238 tokens = 0.85 x 14 ms at 0.05 ms


def test_no_decode_rows_prefill_uses_the_whole_budget() -> None:
    """With nobody decoding, prefill runs at full speed even when costs are known."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost)
    s.add(_req("long", 3000), EOS)
    _prefill_until_done(s, cost, "long/0")
    assert s.step_cost.is_ready
    for name in [r.request_id for r in s.rows.values()]:
        s.abort(name)
    s.add(_req("next", 3000), EOS)
    assert [c.length for c in _step(s, cost).prefill] == [BUDGET]


@pytest.mark.parametrize("factor", [0.0, None])
def test_bound_off_uses_the_token_budget(factor: float | None) -> None:
    """max_stall_factor 0 / unset: today's policy, the token budget alone."""
    cost = FakeCost()
    s = _scheduler(cost, max_stall_factor=factor)
    _decoding(s, cost)
    s.add(_req("long", 3000), EOS)
    assert _step(s, cost).num_tokens == BUDGET


@pytest.mark.parametrize("factor", [1.0, 0.5, -2.0])
def test_stall_factor_validated(factor: float) -> None:
    with pytest.raises(ValueError, match="max_stall_factor"):
        EngineConfig(max_stall_factor=factor)


def test_long_prompt_finishes_while_short_prompts_keep_arriving() -> None:
    """A new short prompt every step: each is served within three steps, and the long
    prompt advances every step that prefills and finishes in bounded steps (no
    starvation). The steps that prefill nothing are the few decode-only steps that
    measure a batch size the cost model has not seen (the decode batch grows here)."""
    cost = FakeCost()
    s = _scheduler(cost, max_num_seqs=32)
    _decoding(s, cost)
    s.add(_req("long", 2000), EOS)
    arrived: dict[str, int] = {}
    first_token: dict[str, int] = {}
    step, measuring = 0, 0
    while s.rows.get("long/0") is None or s.rows["long/0"].is_prefilling:
        name = f"s{step}"
        s.add(_req(name, 24, max_tokens=2), EOS)
        arrived[name] = step
        before = s.rows["long/0"].num_computed if "long/0" in s.rows else 0
        if _step(s, cost).prefill:
            assert s.rows["long/0"].num_computed - before >= MIN_PREFILL_TOKENS
        else:
            measuring += 1
        first_token.update({r.request_id: step for r in s.rows.values() if r.output_ids})
        step += 1
        assert step <= 24, "the long prompt is starved"
    assert measuring <= 3
    _step(s, cost)
    first_token.update({r.request_id: step for r in s.rows.values() if r.output_ids})
    assert all(first_token[n] - arrived[n] <= 3 for n in arrived if n in first_token)
    assert len(first_token) >= len(arrived) - 1  # the last arrivals may still be going


def test_short_prompt_runs_ahead_of_the_decode_rows() -> None:
    """With the decode rows' costs and a prefill-only step's learned, a short prompt
    arriving alone runs in a prefill-only step (its first token a decode step sooner);
    the rows run next, and the two steps together stay within 2x a decode-only step. A
    prompt arriving right after is not run ahead again; one too long for the allowance,
    or arriving while another prefills, goes next to the rows."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost)  # the rows' first step, a 32-token prefill, sampled: learned
    s.add(_req("short", 24), EOS)
    ahead = _step(s, cost)
    assert not ahead.decode_row_ids and ahead.sample_row_ids == ("short/0",)
    s.add(_req("next", 24), EOS)
    after = _step(s, cost)
    assert len(after.decode_row_ids) == 5 and [c.row_id for c in after.prefill] == ["next/0"]
    assert cost.seconds(ahead) + cost.seconds(after) <= 2 * cost.decode_only(4) + 1e-12
    for _ in range(2):
        _step(s, cost)
    s.add(_req("long", 100), EOS)  # 15 ms alone: more than the 11.9 ms allowed
    assert _step(s, cost).decode_row_ids
    s.add(_req("short2", 24), EOS)  # "long" is still prefilling
    out = _step(s, cost)
    assert out.decode_row_ids and {c.row_id for c in out.prefill} == {"long/0", "short2/0"}


@pytest.mark.parametrize(("factor", "ahead"), [(2.0, False), (4.0, True)])
def test_a_pipelined_engine_prices_the_rows_refill_into_a_jump(factor: float, ahead: bool) -> None:
    """On an engine whose decode steps pipeline, a jump drains the rows' pipeline: it
    costs them a decode step more than in lockstep. The short prompt that runs ahead in
    lockstep at the 2x bound (11.2 ms alone, 12.6 ms allowed next to 4 rows' 14 ms step:
    test_short_prompt_runs_ahead_of_the_decode_rows) goes next to the rows instead; a
    looser bound that leaves room for the refill still lets it jump."""
    cost = FakeCost()
    s = _scheduler(cost, pipelined=True, max_stall_factor=factor)
    _decoding(s, cost)
    s.add(_req("short", 24), EOS)
    out = _step(s, cost)
    assert (not out.decode_row_ids) == ahead
    if ahead:
        limit = HEADROOM * (factor - 1) * cost.decode_only(4) - cost.decode_only(4)
        assert out.sample_row_ids == ("short/0",) and cost.seconds(out) <= limit
    else:
        assert [c.row_id for c in out.prefill] == ["short/0"]


def test_rows_that_joined_while_a_prompt_prefilled_are_measured() -> None:
    """The decode line was learned at 4 rows; 12 more join while a long prompt prefills
    (each through its own chunk, so no decode-only step comes). The scheduler measures
    the new batch size with one decode-only step instead of extrapolating the old line:
    extrapolated, every chunk's residual looked like a high token price and the long
    prompt ran at the minimum chunk for good. Afterwards its steps use most of the room
    at 16 rows and stay within the bound."""
    cost = FakeCost()
    s = _scheduler(cost, max_num_seqs=32)
    _decoding(s, cost)
    s.add(_req("long", 15000, max_tokens=2), EOS)
    for _ in range(6):  # the probe and the slow start
        _step(s, cost)
    for i in range(12):
        s.add(_req(f"j{i}", 8, max_tokens=1000), EOS)
    outs = [_step(s, cost) for _ in range(16)]
    assert all(len(o.decode_row_ids) == 16 for o in outs[-8:])
    measuring = [o for o in outs if not o.prefill]
    assert len(measuring) == 1 and len(measuring[0].decode_row_ids) == 16
    for out in outs[-4:]:
        assert cost.seconds(out) <= 2 * cost.decode_only(16) + 1e-12
        assert cost.seconds(out) >= (1 + 0.9 * HEADROOM) * cost.decode_only(16)


def test_allowance_adapts_when_costs_change() -> None:
    """Prefill gets twice as expensive: within a few steps the allowance halves and the
    bound holds again."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost)
    s.add(_req("long", 15000, max_tokens=2), EOS)
    for _ in range(6):  # the probe and the slow start (16 .. 256 tokens)
        _step(s, cost)
    before = _step(s, cost).num_tokens - 4
    cost.per_token *= 2
    outs = [_step(s, cost) for _ in range(12)]
    after = outs[-1].num_tokens - 4
    assert before == 238 and after == 119
    assert all(cost.seconds(o) <= 2 * cost.decode_only(4) + 1e-12 for o in outs[-4:])


def test_real_engine_default_config_tokens_unchanged() -> None:
    """Default config (latency bound on, real clock) on the tiny model: a long prompt
    joining decoding rows gets the same greedy tokens as with the bound off."""
    loaded = load_model(str(cached_checkpoint("tiny")))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[100 + 7 * i + j for j in range(5 + 9 * i)] for i in range(4)] + [
        [1000 + (13 * j) % 5000 for j in range(600)]
    ]

    def run(config: EngineConfig) -> dict[str, list[int]]:
        engine = LLMEngine(loaded, config)
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts[:4]):
            engine.add_request(GenerationRequest(f"r{i}", tuple(prompt), params))
        step = 0
        while engine.has_work():
            if step == 6:
                engine.add_request(GenerationRequest("long", tuple(prompts[4]), params))
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            step += 1
        return tokens

    bounded = run(EngineConfig(max_num_batched_tokens=512))
    unbounded = run(EngineConfig(max_num_batched_tokens=512, max_stall_factor=0))
    assert bounded == unbounded and len(bounded["long"]) == 24


@pytest.mark.parametrize(
    ("snapshots", "in_chunk", "ahead"),
    [([8, 16], True, False), ([8], True, True), ([8], False, False), ([24], False, True)],
)
def test_prompt_cut_by_snapshots_does_not_run_ahead(
    snapshots: list[int], in_chunk: bool, ahead: bool
) -> None:
    """A prompt runs ahead only as one chunk that samples: a snapshot before its end cuts
    the chunk there unless the forward keeps it inside (snapshot_in_chunk, one at most);
    one at its very end does not cut it."""
    cost = FakeCost()
    s = _scheduler(cost, snapshot_in_chunk=in_chunk)
    _decoding(s, cost)
    s.add(_req("short", 24), EOS)
    s.waiting[0].snapshot_at = list(snapshots)
    out = _step(s, cost)
    assert (not out.decode_row_ids) == ahead
    if ahead:
        assert out.sample_row_ids == ("short/0",)


@pytest.mark.parametrize("gpu_defaults", [False, True])
@pytest.mark.parametrize("pipeline", [False, True])
def test_engine_tokens_unchanged_by_prompts_run_ahead_of_the_rows(
    pipeline: bool, gpu_defaults: bool
) -> None:
    """The tiny model on a fake clock (FakeCost): short prompts arriving while rows decode
    run in prefill-only steps ahead of them, lockstep or pipelined, with the CPU's
    defaults or the GPU's (compiled decode over bucketed rows, batched prefill), and every
    request's greedy tokens equal a run with the bound off (no step ahead)."""
    loaded = load_model(str(cached_checkpoint("tiny")))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [tuple(100 + 7 * i + j for j in range(5 + 9 * i)) for i in range(6)]

    def run(factor: float) -> tuple[dict[str, list[int]], list[StepPlan]]:
        cost = FakeCost(per_row=0.005)  # a decode row costs more than a step's base
        gpu = {"compile_decode": True, "batch_prefill": True} if gpu_defaults else {}
        config = EngineConfig(max_stall_factor=factor, pipeline_steps=pipeline, **gpu)
        engine = LLMEngine(loaded, config, clock=cost)
        plan, outs = engine.scheduler.schedule, []

        def timed() -> StepPlan:
            out = plan()
            cost.now += cost.seconds(out)
            outs.append(out)
            return out

        engine.scheduler.schedule = timed
        tokens: dict[str, list[int]] = {}
        for i in range(4):
            engine.add_request(GenerationRequest(f"r{i}", prompts[i], params))
        step = 0
        while engine.has_work():
            if step in (8, 11):
                i = 4 if step == 8 else 5
                engine.add_request(GenerationRequest(f"r{i}", prompts[i], params))
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            step += 1
        return tokens, outs

    # pipelined, a jump is priced with the rows' refill: a looser bound leaves room for it
    bounded, outs = run(4.0 if pipeline else 2.0)
    ahead = [o for o in outs[1:] if o.prefill and not o.decode_row_ids]
    assert [c.row_id for o in ahead for c in o.prefill] == ["r4/0", "r5/0"]
    assert bounded == run(0.0)[0] and all(len(t) == 16 for t in bounded.values())


def _image_request(length: int, span: tuple[int, int], block_tokens: int, depth: int):
    """A prompt of `length` tokens with one image over `span`, as prepare_media gives."""
    a, b = span
    image = ImageInput(np.zeros((4 * (b - a), 8), np.float32), (1, 2, 2 * (b - a)), b - a, "i")
    media = PromptMedia(
        images=(image,),
        spans=(span,),
        positions=np.zeros((3, length), np.int32),
        rope_delta=0,
        key_ids=tuple(range(length)),
        depth=depth,
        block_tokens=(block_tokens,),
        vision_bytes=1000,
    )
    return _req("img", length), media


def test_tower_blocks_priced_at_their_measured_cost_keep_the_bound() -> None:
    """Tower blocks cost 3x their FLOP estimate. The first step with blocks is a one-block
    probe; from then on blocks are priced at the learned scale, so every step with
    blocks stays within 2x a decode-only step and still runs more than one block."""
    cost = FakeCost(per_vision=3 * FakeCost.per_token)
    s = _scheduler(cost)
    _decoding(s, cost)
    s.add(_req("text", 600), EOS)  # the token cost is known before the image arrives
    _prefill_until_done(s, cost, "text/0")
    req, media = _image_request(300, (10, 250), block_tokens=30, depth=12)
    s.add(req, EOS, media)
    outs = _prefill_until_done(s, cost, "img/0")
    tower = [o for o in outs if any(c.vision for c in o.prefill)]
    blocks = [sum(w.stop - w.start for c in o.prefill for w in c.vision) for o in tower]
    assert blocks[0] == 1 and sum(blocks) == 12 and max(blocks) >= 2
    assert s.step_cost.vision_scale() == pytest.approx(3.0, rel=0.05)  # the line: b = 0
    for out in outs:
        assert cost.seconds(out) <= 2 * cost.decode_only(len(out.decode_row_ids)) + 1e-12


def test_stale_token_cost_is_not_used_after_the_load_changed() -> None:
    """Prompts prefilled next to the decode rows, then a minute of decoding, and prompt
    tokens now cost 3x (another load on the machine): a new long prompt is probed again
    and every one of its steps stays within 2x (the stale cost would give 238 tokens, 3x
    their price)."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost)
    s.add(_req("text", 600, max_tokens=1), EOS)  # done on its first token: 4 rows stay
    while s.waiting or s.state.prefilling:
        _step(s, cost)
    assert s.step_cost.prefill_allowance(4, 2.0) == 238  # learned: 0.05 ms a token
    for _ in range(3):
        cost.now += MAX_AGE / 2  # a slow spell: decode steps far apart
        _step(s, cost)
    cost.per_token *= 3
    s.add(_req("long", 3000), EOS)
    outs = _prefill_until_done(s, cost, "long/0")
    assert sum(c.length for c in outs[0].prefill) == MIN_PREFILL_TOKENS  # a probe again
    for out in outs:
        assert cost.seconds(out) <= 2 * cost.decode_only(len(out.decode_row_ids)) + 1e-12


def test_a_measured_fixed_chunk_cost_past_the_bound_holds_the_chunk_that_repays_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a machine whose prompt chunks cost a fixed 15 ms (a GPU's launches) next to
    14 ms decode steps, no chunk meets the 2x bound: with that cost measured at start
    (ChunkCost) every step next to the rows holds the chunk whose tokens cost as much as
    its fixed part (300 tokens at 0.05 ms), from the first (no probe, no 16-token
    chunks, not the whole budget), and the log says what is promised instead."""
    cost = FakeCost()
    s = _scheduler(cost, chunk_cost=ChunkCost(fixed_seconds=0.015, token_seconds=cost.per_token))
    _decoding(s, cost)
    s.add(_req("long", 3000), EOS)
    with caplog.at_level("INFO", logger="deltaserve.engine.scheduling.prefill_policy"):
        outs = _prefill_until_done(s, cost, "long/0")
    assert [out.num_tokens - len(out.decode_row_ids) for out in outs[:5]] == [300] * 5
    assert all(len(out.decode_row_ids) == 4 for out in outs)
    said = [r.getMessage() for r in caplog.records if "cannot be met" in r.getMessage()]
    assert len(said) == 1 and "a fixed 15.0 ms" in said[0] and "up to 300 tokens" in said[0]


def test_a_measured_chunk_cost_that_fits_the_bound_sizes_chunks_at_once() -> None:
    """With the chunk cost measured at start and room for it under the bound (a fixed
    3 ms next to 14 ms decode steps), the first step next to the rows already holds the
    measured line's fit (no 16-token probe, no slow start: on a GPU small odd chunks are
    shapes not compiled yet), and every step keeps the 2x bound."""
    cost = FakeCost()
    s = _scheduler(cost, chunk_cost=ChunkCost(fixed_seconds=0.003, token_seconds=cost.per_token))
    _decoding(s, cost)
    s.add(_req("long", 3000), EOS)
    outs = _prefill_until_done(s, cost, "long/0")
    fit = int((HEADROOM * cost.decode_only(4) - 0.003) / cost.per_token + 1e-6)
    assert [out.num_tokens - 4 for out in outs[:3]] == [fit] * 3  # 178 from the first
    assert all(cost.seconds(o) <= 2 * cost.decode_only(4) + 1e-12 for o in outs)


def test_a_step_that_traced_a_shape_is_no_cost_sample_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A step whose time holds a compiled shape's first trace (StepResult.traced) is a
    one-off: the cost model does not learn from it, and a slow one is logged at INFO with
    its cause; other slow steps at most one per SLOW_STEP_EVERY seconds, with a count."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost)
    predicted, samples = s.step_cost.decode_seconds(4), len(s.step_cost._decode)
    with caplog.at_level("INFO", logger="deltaserve.engine.scheduling.scheduler"):
        for _ in range(3):  # decode-only steps of 0.5 s, each tracing a shape
            out = s.schedule()
            cost.now += 0.5
            s.update(out, replace(sampled(out), traced=1))
        assert s.step_cost.decode_seconds(4) == pytest.approx(predicted)
        assert len(s.step_cost._decode) == samples
        said = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
        assert len(said) == 3 and all("it traced 1 new compiled shape(s)" in m for m in said)
        caplog.clear()
        for _ in range(3):  # slow without a trace: learned from, logged once
            out = s.schedule()
            cost.now += 0.5
            s.update(out, sampled(out))
        cost.now += SLOW_STEP_EVERY
        _step(s, cost)  # a fast step says nothing
        out = s.schedule()
        cost.now += 0.3
        s.update(out, sampled(out))
    said = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(said) == 2 and "4 decode rows" in said[0] and "traced" not in said[0]
    assert "(2 more slow steps since the last)" in said[1]
    assert len(s.step_cost._decode) == samples + 5  # the slow steps are samples


def test_a_backlog_behind_the_bound_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A burst of prompts next to decoding rows is admitted at the stall bound's
    allowance: the log says so (how many wait, the allowance, the knob), at most once
    per BACKLOG_EVERY seconds while it lasts, and not for a lone prompt."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost, rows=8)

    def said() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if "wait for their first token" in r.getMessage()
        ]

    with caplog.at_level("INFO", logger="deltaserve.engine.scheduling.prefill_policy"):
        s.add(_req("alone", 400), EOS)
        _prefill_until_done(s, cost, "alone/0")
        assert said() == []
        for i in range(10):
            s.add(_req(f"b{i}", 400), EOS)
        for _ in range(3):
            _step(s, cost)
        assert len(said()) == 1
        assert "10 requests" in said()[0] and "--max-stall-factor 0" in said()[0]
        cost.now += BACKLOG_EVERY
        _step(s, cost)
        assert len(said()) == 2
    assert all(c.length <= BUDGET for c in s.schedule().prefill)


def test_a_burst_next_to_few_decoding_rows_gets_a_fair_share_of_the_step() -> None:
    """Prompts waiting for their first token and rows waiting for their next share a
    step's time per stream: with Q prompts queued next to D decoding rows a step may take
    (1 + Q/D) x a decode-only step, more than the configured 2x, so a burst clears in a
    few steps; a lone prompt next to the rows keeps the 2x bound."""
    cost = FakeCost()
    s = _scheduler(cost)
    _decoding(s, cost, rows=2)
    s.add(_req("alone", 3000), EOS)
    _prefill_until_done(s, cost, "alone/0")
    for i in range(12):
        s.add(_req(f"b{i}", 400), EOS)
    over = 0
    while any(r.is_prefilling for r in s.rows.values()) or s.state.waiting:
        st = s.state
        free = 16 - len(st.decoding) - len(st.prefilling)
        share = 1 + (len(st.prefilling) + min(len(st.waiting), free)) / len(st.decoding)
        out = _step(s, cost)
        ratio = cost.seconds(out) / cost.decode_only(len(out.decode_row_ids))
        assert ratio <= max(2.0, share) + 1e-9
        over += ratio > 2.0 + 1e-9
    assert over >= 2  # the burst took more than the 2x bound's allowance
    for name in [r.request_id for r in s.rows.values() if r.request_id.startswith("b")]:
        s.abort(name)
    s.add(_req("lone", 3000), EOS)
    for out in _prefill_until_done(s, cost, "lone/0"):
        assert cost.seconds(out) <= 2 * cost.decode_only(len(out.decode_row_ids)) + 1e-12


def test_every_step_is_counted_by_kind_for_metrics() -> None:
    """StepTimes (/metrics' deltaserve_step_seconds): each step's wall time under its kind,
    cumulative per bucket bound as Prometheus reads them, and the steps that traced."""
    cost = FakeCost()
    s = _scheduler(cost)
    s.add(_req("a", 100, max_tokens=1000), EOS)
    _step(s, cost)  # prefill only: 0.010 + 100 x 0.00005 = 0.015 s
    _step(s, cost)  # one decode row: 0.011 s
    s.add(_req("b", 200), EOS)
    _step(s, cost)  # mixed: 0.011 + 200 x 0.00005 = 0.021 s
    out = s.schedule()
    cost.now += 0.3
    s.update(out, replace(sampled(out), traced=2))  # a decode step that traced: 0.3 s
    times = s.step_times.snapshot()
    counts = dict(zip(STEP_KINDS, times.counts, strict=True))
    seconds = dict(zip(STEP_KINDS, times.seconds, strict=True))
    at = {b: i for i, b in enumerate(STEP_SECONDS_BUCKETS)}
    assert counts["prefill"][at[0.01]] == 0 and counts["prefill"][at[0.02]] == 1
    assert counts["mixed"][at[0.02]] == 0 and counts["mixed"][at[0.05]] == 1
    assert counts["decode"][at[0.02]] == 1 and counts["decode"][at[0.25]] == 1
    assert counts["decode"][at[0.5]] == 2 and counts["decode"][-1] == 2
    assert counts["verify"][-1] == 0
    assert seconds["decode"] == pytest.approx(0.311) and seconds["mixed"] == pytest.approx(0.021)
    assert times.traced == 1


def test_the_runner_reports_the_shapes_a_step_traced() -> None:
    """With the compiled paths on, a fresh engine's first prompt and decode steps report
    the shapes they ran first (StepResult.traced); the same work again reports none."""
    loaded = load_model(str(cached_checkpoint("tiny")))
    cfg = EngineConfig(compile_decode=True, compile_prompt=True, batch_prefill=True)
    engine = LLMEngine(loaded, cfg)
    traced: list[int] = []
    update = engine.scheduler.update

    def spy(plan: StepPlan, result):  # noqa: ANN202 (a pass-through)
        traced.append(result.traced)
        return update(plan, result)

    engine.scheduler.update = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for run in range(2):
        traced.clear()
        engine.add_request(GenerationRequest(f"r{run}", tuple(range(5, 25)), params))
        while engine.has_work():
            engine.step()
        if run == 0:
            assert traced[0] >= 1 and traced[1] >= 1 and sum(traced) == 2  # [1, 32], decode
        else:
            assert traced and not any(traced)


@pytest.mark.parametrize("later_fixed", [None, 0.0, 0.017])
def test_fresh_prompts_wait_whole_where_chunk_costs_are_measured(
    later_fixed: float | None,
) -> None:
    """Where a chunk's fixed cost was measured (a GPU; whether a later chunk's fixed part
    is above a first one's or not), prompts that fit a chunk run as one chunk each
    instead of one starting with a step's leftover; without a measurement (the CPU) the
    leftover is used."""
    cost = FakeCost()
    measured = None if later_fixed is None else ChunkCost(0.009, 3.3e-5, later_fixed)
    s = _scheduler(cost, chunk_cost=measured)
    for i in range(4):
        s.add(_req(f"p{i}", 300), EOS)
    chunks = []
    while any(r.is_prefilling for r in s.rows.values()) or s.state.waiting:
        chunks += [(c.row_id, c.start, c.length) for c in _step(s, cost).prefill]
    if later_fixed is not None:
        assert chunks == [(f"p{i}/0", 0, 300) for i in range(4)]
    else:
        assert ("p1/0", 0, 212) in chunks and ("p1/0", 212, 88) in chunks


def test_a_chunk_group_of_its_own_pays_its_fixed_part_out_of_the_step() -> None:
    """Where a chunk's fixed part was measured (100 tokens' worth here), a step's prompt
    work that starts a second group pays it out of the allowance: next to a long
    prompt's later chunk a fresh prompt costs its tokens and 100 more, fresh prompts
    beside a fresh one (one group) only their tokens; a step never holds more groups
    than its allowance repays. Without a measurement (the CPU) nothing is charged."""
    cost = FakeCost()

    three = (("a", 100), ("b", 100), ("c", 100))

    def plans(
        measured: ChunkCost | None, prompts: tuple[tuple[str, int], ...] = three
    ) -> list[list[tuple[str, int, int]]]:
        s = _scheduler(cost, chunk_cost=measured, max_prefill_chunk=BUDGET, max_stall_factor=0)
        s.add(_req("long", 3000), EOS)
        _step(s, cost)  # its first chunk: every later one is a group of its own
        for name, length in prompts:
            s.add(_req(name, length), EOS)
        steps = []
        for _ in range(3):
            out = _step(s, cost)
            steps.append([(c.row_id, c.start, c.length) for c in out.prefill])
        return steps

    charged = plans(ChunkCost(fixed_seconds=0.005, token_seconds=5e-5))
    # long takes half while others wait; "a" pays 100 + 100 of the other half; "b" (one
    # group with "a") does not fit the 56 left and waits whole; long takes the rest
    assert charged[0] == [("long/0", 512, 312), ("a/0", 0, 100)]
    # "a" decodes now (the budget is 511): the same with "b"
    assert charged[1] == [("long/0", 824, 311), ("b/0", 0, 100)]
    # a short fresh prompt joins the fresh group in what is left, with no charge
    short = plans(ChunkCost(fixed_seconds=0.005, token_seconds=5e-5), (("a", 100), ("s", 40)))
    assert short[0] == [("long/0", 512, 272), ("a/0", 0, 100), ("s/0", 0, 40)]
    # without a measurement (and so without whole prompts) "b" joins at once, and "c"
    # starts with what is left
    uncharged = plans(None)
    assert uncharged[0] == [("long/0", 512, 256), ("a/0", 0, 100), ("b/0", 0, 100), ("c/0", 0, 56)]


def test_a_fresh_prompt_that_would_split_the_fresh_call_pays_a_fixed_part() -> None:
    """Fresh prompts' first chunks run as one compiled call only while their padded
    bucket fits the chunk size (engine/shapes.py cohort_splits); a prompt that would
    split the call in two is charged a fixed part (100 tokens' worth here) like any group
    of its own, so it waits for the next step where its tokens fit but the charge does
    not. Prompts of 200 and 150 tokens share a [2, 256] bucket (512 padded tokens, the
    chunk size); a third of 100 would make it [4, 256] and a second call."""
    cost = FakeCost()
    s = _scheduler(cost, chunk_cost=ChunkCost(fixed_seconds=0.005, token_seconds=5e-5))
    for name, length in (("a", 200), ("b", 150), ("c", 100)):
        s.add(_req(name, length), EOS)
    first = [(c.row_id, c.length) for c in _step(s, cost).prefill]
    assert first == [("a/0", 200), ("b/0", 150)]  # 162 tokens left: c's 100 + 100 charged
    assert [(c.row_id, c.length) for c in _step(s, cost).prefill] == [("c/0", 100)]
    # without a measurement (the CPU, no compiled call) nothing is charged
    s = _scheduler(cost)
    for name, length in (("a", 200), ("b", 150), ("c", 100)):
        s.add(_req(name, length), EOS)
    assert [c.row_id for c in _step(s, cost).prefill] == ["a/0", "b/0", "c/0"]
