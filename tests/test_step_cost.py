"""StepCostModel and StepTimer (engine/scheduling/step_cost.py) on synthetic step samples: the
decode line, token and tower prices, outliers, ageing, and which step times settle."""

from __future__ import annotations

import pytest

from deltaserve.engine.scheduling.step_cost import (
    MAX_AGE,
    MIN_CHUNK,
    ChunkCost,
    StepCostModel,
    StepTimer,
)


def test_step_timer_drops_the_first_pipelined_steps_after_lockstep() -> None:
    """Pipelined steps are timed completion to completion and settle from the third one
    after a lockstep step (the first holds the next plan's building too, the second
    still runs slow); lockstep steps are their own time."""
    timer = StepTimer()
    timer.planned(0, 0.0)  # after a lockstep step (or idle)
    timer.planned(1, 0.3)  # pipelined: planned before step 0 is read back
    assert timer.completed(0, 1.0) == (1.0, False)
    timer.planned(2, 1.2)
    assert timer.completed(1, 1.5) == (0.5, False)  # its predecessor was not overlapped
    timer.planned(3, 1.6)
    assert timer.completed(2, 1.9) == pytest.approx((0.4, True))  # steady state
    assert timer.completed(3, 2.2) == pytest.approx((0.3, True))  # nothing planned after it
    timer.planned(4, 2.3)  # lockstep: planned after step 3 completed, nothing queued behind
    assert timer.completed(4, 2.5) == pytest.approx((0.2, True))


def test_step_timer_prices_a_pipelined_steps_building_to_it() -> None:
    """A pipelined step's building runs in the gap that ends with its predecessor's
    completion: each gap gives the next step's building to it and takes its own step's,
    so a heavy build (a prompt chunk's) is priced to its step and the total stays the
    wall time."""
    timer = StepTimer()
    builds = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.6, 4: 0.1}  # step 3 builds a prompt chunk
    at, done = 0.0, []
    for step in range(5):
        timer.planned(step, at)
        timer.submitted(step, at + builds[step])
        at += builds[step]
        if step:  # the step before completes after this one is submitted
            done.append(timer.completed(step - 1, at + 0.2))
            at += 0.2
    done.append(timer.completed(4, at + 0.3))
    seconds = [s for s, _ in done]
    assert seconds[2] == pytest.approx(0.2 + 0.1)  # its gap held step 3's 0.6 s build
    assert seconds[3] == pytest.approx(0.2 + 0.6)
    assert sum(seconds) == pytest.approx(at + 0.3)
    assert [settled for _, settled in done] == [False, False, True, True, True]


def test_step_timer_keeps_a_lockstep_steps_build_after_a_pipelined_one() -> None:
    """A step planned while its predecessor ran but built only after it completed (the
    engine drained first: lockstep) holds its building in its own gap already: neither
    gap moves it."""
    timer = StepTimer()
    timer.planned(0, 0.0)
    timer.submitted(0, 0.1)
    timer.planned(1, 0.1)  # planned before step 0 completed ...
    assert timer.completed(0, 0.4)[0] == pytest.approx(0.4)
    timer.submitted(1, 0.9)  # ... built after it (0.5 s)
    assert timer.completed(1, 1.2)[0] == pytest.approx(0.8)


def test_cost_model_ignores_outliers() -> None:
    """One very slow decode step (a pause, a compile) barely moves the estimates."""
    model = StepCostModel()
    for i in range(10):
        model.observe(4, 0, 0.014 + 0.0001 * (i % 2))
        model.observe(4, 200, 0.024)
    model.observe(4, 0, 1.0)
    model.observe(4, 200, 1.0)
    assert model.decode_seconds(4) == pytest.approx(0.014, rel=0.02)
    assert model.token_seconds() == pytest.approx(0.00005, rel=0.05)


def test_cost_model_fits_decode_rows_slope() -> None:
    model = StepCostModel()
    for rows in (1, 2, 4, 8, 4, 2):
        model.observe(rows, 0, 0.010 + 0.001 * rows)
    assert model.decode_seconds(16) == pytest.approx(0.026)


def test_cost_model_learns_what_tower_work_costs_apart_from_tokens() -> None:
    """Steps with tower blocks cost 3x what their token equivalents say: the model learns
    that scale from them and keeps the prompt tokens' cost as the text steps measured it."""
    model = StepCostModel()
    for _ in range(5):
        model.observe(4, 0, 0.014)
    assert model.vision_scale() == 1.0 and model.vision_limit() == 0  # nothing seen yet
    for _ in range(4):
        model.observe(4, 200, 0.024)
        model.observe(4, 0, 0.014 + 100 * 0.00015, num_vision=100)
        model.observe(4, 50, 0.014 + 50 * 0.00005 + 20 * 0.00015, num_vision=20)
    assert model.token_seconds() == pytest.approx(0.00005)
    assert model.vision_seconds() == pytest.approx(0.00015)
    assert model.vision_scale() == pytest.approx(3.0)
    assert model.vision_limit() == 200  # slow start: twice the most seen in one step
    assert model.predict(4, 10, 10) == pytest.approx(0.014 + 0.0005 + 0.0015)
    assert model.prefill_allowance(4, 2.0) == 238  # in tokens: 0.85 x 14 ms of them


def test_cost_model_with_tower_steps_only_counts_equivalents_as_tokens() -> None:
    """An image at the prompt's start: no text-only step yet, so tokens and equivalents
    share one cost (scale 1) until text steps tell them apart."""
    model = StepCostModel()
    for _ in range(5):
        model.observe(4, 0, 0.014)
    model.observe(4, 20, 0.014 + 120 * 0.0001, num_vision=100)
    assert model.token_seconds() == pytest.approx(0.0001)
    assert model.vision_scale() == 1.0
    assert model.prefill_allowance(4, 2.0) == 119  # 0.85 x 14 ms / 0.1 ms (cap: 2 x 120)


def test_one_lucky_tower_step_does_not_make_blocks_free() -> None:
    """A step with blocks that happened to take no longer than a decode-only step, then a
    normal one: the price stays near the true 3x (a median of the two would say ~0)."""
    model = StepCostModel()
    for _ in range(5):
        model.observe(4, 0, 0.014)
    model.observe(4, 200, 0.024)
    model.observe(4, 0, 0.014 + 2 * 100 * 0.00015, num_vision=100)
    model.observe(4, 0, 0.014, num_vision=100)  # lucky: the tower looked free
    assert 2.5 < model.vision_scale() < 3.0


def test_slow_decode_step_under_3x_does_not_lift_the_line() -> None:
    """The newest decode step ran at 2.1x (an image decoded on the same cores): dropped,
    where a cut at 3x kept it with the most weight and lifted the line ~12%."""
    model = StepCostModel()
    for _ in range(20):
        model.observe(8, 0, 0.8)
    model.observe(8, 0, 1.7)
    assert model.decode_seconds(8) == pytest.approx(0.8)


def test_outlier_cut_is_per_decode_batch_size() -> None:
    """Mostly 1-row steps in the window: the 8-row steps at 2.75x their median stay."""
    model = StepCostModel()
    for _ in range(12):
        model.observe(1, 0, 0.4)
    for _ in range(4):
        model.observe(8, 0, 1.1)
    assert model.decode_seconds(8) == pytest.approx(1.1)
    assert model.decode_seconds(1) == pytest.approx(0.4)


def test_prompt_token_samples_age_out() -> None:
    """Prompt-token samples older than MAX_AGE seconds before the newest step are
    forgotten: the allowance is a probe again, then the cost measured now."""
    model = StepCostModel()
    for i in range(5):
        model.observe(4, 0, 0.014, done=i)
    for i in range(5, 10):
        model.observe(4, 200, 0.024, done=i)
    late = 9 + MAX_AGE - 1
    model.observe(4, 0, 0.014, done=late)
    assert model.prefill_allowance(4, 2.0) == 238  # still within MAX_AGE
    model.observe(4, 0, 0.014, done=late + 2)
    assert model.prefill_allowance(4, 2.0) == 0  # all aged out: probe
    model.observe(4, 16, 0.014 + 16 * 0.0002, done=late + 3)
    assert model.token_seconds() == pytest.approx(0.0002)
    assert model.prefill_allowance(4, 2.0) == 32  # slow start again (fit: 59)


def test_tower_samples_age_out() -> None:
    """After MAX_AGE the next image's tower starts from one block again."""
    model = StepCostModel()
    for i in range(5):
        model.observe(4, 0, 0.014, done=i)
    model.observe(4, 200, 0.024, done=5)
    model.observe(4, 0, 0.014 + 100 * 0.00015, num_vision=100, done=6)
    assert model.vision_limit() == 200
    model.observe(4, 0, 0.014, done=7 + MAX_AGE)
    assert model.vision_limit() == 0 and model.vision_scale() == 1.0


def test_a_few_prompt_tokens_do_not_price_tower_work() -> None:
    """A 4-token chunk that ran faster than the decode line: with fewer than 16 prompt
    tokens measured, tokens and tower equivalents share one cost (scale 1), instead of
    tokens at the floor and tower work at hundreds of tokens each."""
    model = StepCostModel()
    for _ in range(5):
        model.observe(4, 0, 0.014)
    model.observe(4, 4, 0.013)
    model.observe(4, 0, 0.014 + 14 * 0.0003, num_vision=14)
    assert model.vision_scale() == 1.0
    assert model.token_seconds() == pytest.approx(0.0003)  # 14 equivalents outweigh 4
    model.observe(4, 16, 0.014 + 16 * 0.0001)
    assert model.token_seconds() == pytest.approx(0.0001)
    assert model.vision_scale() == pytest.approx(3.0)


def test_prefill_only_steps_that_sample_price_a_step_ahead_of_the_rows() -> None:
    """Prefill-only steps that sample a first token give their own line; those that
    sample nothing (no LM head) or carry tower work are not in it. Past the largest step
    seen it grows in proportion (an upper bound), and in proportion to the samples' mean
    while the line is flat (one size seen)."""
    model = StepCostModel()
    assert model.alone_seconds(10) is None
    model.observe(0, 100, 0.5)  # a chunk that samples nothing
    model.observe(0, 100, 0.5, num_vision=10, first_tokens=1)  # tower work
    assert model.alone_seconds(10) is None
    model.observe(0, 40, 0.012, first_tokens=1)
    assert model.alone_seconds(20) == pytest.approx(0.006)  # one size: in proportion
    assert model.alone_seconds(80) == pytest.approx(0.024)
    model.observe(0, 20, 0.011, first_tokens=2)
    assert model.alone_seconds(30) == pytest.approx(0.0115)  # the line 0.010 + 5e-5 P
    assert model.alone_seconds(80) == pytest.approx(0.012 * 2)


def test_time_spent_ahead_of_the_rows_comes_off_the_next_allowance() -> None:
    model = StepCostModel()
    for _ in range(5):
        model.observe(4, 0, 0.014)
    model.observe(4, 200, 0.024)  # 0.05 ms a token
    assert model.stall_seconds(4, 2.0) == pytest.approx(0.85 * 0.014)
    assert model.prefill_allowance(4, 2.0) == 238
    assert model.prefill_allowance(4, 2.0, spent=0.005) == 138
    assert model.prefill_allowance(4, 2.0, spent=1.0) == 0


def test_a_fixed_chunk_cost_buys_larger_chunks_not_the_minimum() -> None:
    """Where a chunk's cost is mostly fixed (a GPU's launches: 16 tokens cost about what
    256 do) the bound cannot be met by any chunk; the allowance first probes a larger one
    to learn the fixed part, then sizes chunks to repay it, and says so (`unattainable`)."""
    model = StepCostModel()
    for _ in range(5):
        model.observe(8, 0, 0.006)
    model.observe(8, 16, 0.030)  # 24 ms over the decode step for 16 tokens
    assert model.prefill_allowance(8, 2.0) == 32  # probe: GROWTH x the largest seen
    assert model.unattainable is None  # one size seen: the fixed part is unknown
    model.observe(8, 32, 0.0305)
    fixed, token = model.prefill_line()
    assert fixed == pytest.approx(0.0235, rel=1e-3) and token == pytest.approx(3.125e-5)
    assert model.prefill_allowance(8, 2.0) == 64  # repays 23.5 ms; slow start caps it
    assert model.unattainable == pytest.approx((fixed, token))


def test_expensive_tokens_without_a_fixed_cost_keep_the_minimum_chunk() -> None:
    """Where a chunk's cost grows with its tokens (no fixed part) nothing is repaid by a
    larger chunk: after the probe the allowance falls back to the minimum."""
    model = StepCostModel()
    for _ in range(5):
        model.observe(8, 0, 0.006)
    model.observe(8, 16, 0.022)  # 1 ms a token
    assert model.prefill_allowance(8, 2.0) == 32
    model.observe(8, 32, 0.038)
    fixed, token = model.prefill_line()
    assert fixed == pytest.approx(0.0, abs=1e-9) and token == pytest.approx(1e-3)
    assert model.prefill_allowance(8, 2.0) == 16


def test_a_measured_fixed_cost_past_the_bound_sets_the_chunk_that_repays_it() -> None:
    """With the chunk cost measured at start (ChunkCost) and its fixed part alone past the
    bound, steps next to the decode rows hold the chunk whose tokens cost as much as its
    fixed part, at once (no probe, no slow start, not the whole token budget); where the
    bound leaves room for it, the measured line's fit applies at once, never below that
    chunk, or no chunk right after a jump that left less room than it."""
    cost = ChunkCost(fixed_seconds=0.010, token_seconds=3e-5)
    model = StepCostModel(cost)
    for _ in range(5):
        model.observe(8, 0, 0.006)
    assert model.prefill_allowance(8, 2.0) == 333  # 10 ms fixed > 0.85 * 6 ms: 10 ms of tokens
    assert model.unattainable == (0.010, 3e-5)
    slow = StepCostModel(cost)
    for _ in range(5):
        slow.observe(64, 0, 0.030)  # a decode step of 30 ms leaves 25.5 ms
    slow.observe(64, 100, 0.033)
    assert slow.prefill_allowance(64, 2.0) == 516  # (25.5 - 10) ms / 0.03 ms, no slow start
    # after a jump of 12 ms the 13.5 ms left buy less than the floor chunk: none (a chunk
    # would stack its fixed part on the jump)
    assert slow.prefill_allowance(64, 2.0, spent=0.012) == 0
    assert slow.unattainable is None
    fresh = StepCostModel(cost)
    for _ in range(5):
        fresh.observe(64, 0, 0.030)
    assert fresh.prefill_allowance(64, 2.0) == 516  # no probe first: the line is measured


def test_budget_tokens_from_a_measured_chunk_cost() -> None:
    """The default token budget makes a step's tokens cost 4x its fixed part, in steps of
    256 tokens within [512, 8192]."""
    assert ChunkCost(0.010, 3e-5).budget_tokens() == 1280
    assert ChunkCost(0.001, 1e-4).budget_tokens() == 512
    assert ChunkCost(0.100, 1e-6).budget_tokens() == 8192


def test_a_later_chunks_fixed_cost_past_the_bound_lifts_the_allowance() -> None:
    """A first chunk that runs compiled may fit the bound while a prompt's later chunks
    (eager, over the row's state) do not: a prompt split into small chunks pays the later
    fixed part for each, so the bound counts as unattainable and steps hold the chunk
    that repays the later fixed part (H200, 0.8B: 7 ms first, 14 ms later, a ~10 ms
    decode step of 16 rows)."""
    cost = ChunkCost(fixed_seconds=0.007, token_seconds=3.5e-5, later_fixed_seconds=0.014)
    model = StepCostModel(cost)
    for _ in range(5):
        model.observe(16, 0, 0.010)
    first_chunk = cost.fixed_seconds + cost.token_seconds * MIN_CHUNK
    assert first_chunk < model.stall_seconds(16, 2.0) < cost.split_seconds(MIN_CHUNK)
    assert model.prefill_allowance(16, 2.0) == 400  # 14 ms of tokens at 0.035 ms
    assert model.unattainable == (0.014, 3.5e-5)


def test_a_measured_chunk_cost_bounds_a_jumps_price() -> None:
    """Where the chunk cost was measured at start, a prefill-only step is priced at no
    less than that chunk: a line from a few early prefill-only steps can price a short
    jump far below what it costs (H100, 9B: under 9.3 ms for one of 24 ms)."""
    model = StepCostModel(ChunkCost(fixed_seconds=0.0112, token_seconds=2.7e-5))
    model.observe(0, 200, 0.020, first_tokens=1)
    model.observe(0, 400, 0.040, first_tokens=1)
    assert model._alone_fit(53) == pytest.approx(0.0053)  # the line alone: 0.1 ms a token
    assert model.alone_seconds(53) == pytest.approx(0.0112 + 53 * 2.7e-5)
    assert model.alone_seconds(400) == pytest.approx(0.040)  # above the prior: the line


def test_after_a_jump_the_rows_step_holds_no_chunk_the_floor_would_break() -> None:
    """Measured costs where no chunk meets the bound (9B on an H100: a 12.7 ms fixed part
    beside 10.9 ms decode steps): a step holds the floor chunk, but not right after a
    jump the rows already waited out, which would stack the two (jump + a full chunk)."""
    model = StepCostModel(ChunkCost(fixed_seconds=0.0127, token_seconds=2.7e-5))
    for _ in range(5):
        model.observe(16, 0, 0.0109)
    floor = ChunkCost(0.0127, 2.7e-5).floor_tokens()
    assert model.prefill_allowance(16, 2.0) == floor
    assert model.prefill_allowance(16, 2.0, spent=0.012) == 0
