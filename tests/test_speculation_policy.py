"""The scheduler's speculation policy (engine/scheduling/speculation.py), without a model:
rows whose drafts never land back off exponentially, so speculation at 0% acceptance
costs about a plain step; rows whose drafts land keep drafting; a probe that lands ends
the back-off; once verify steps are timed, the break-even is what a verify costs on the
device (rows that would win at the default floor stop where a verify costs more than
they gain, and rows below the floor keep drafting where a verify is nearly free)."""

from __future__ import annotations

import pytest

from deltaserve.engine.request import Request
from deltaserve.engine.scheduling.speculation import (
    COST_SAMPLES,
    MAX_PAUSE_STEPS,
    MIN_ACCEPTANCE,
    PAUSE_STEPS,
    PROBE_STEPS,
    WINDOW_STEPS,
    Speculation,
)
from deltaserve.engine.types import SamplingParams

K = 2


def _row(name: str = "r") -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=1_000_000, ignore_eos=True)
    req = Request(name, 0, [1, 2, 3], params, frozenset(), 2_000_000)
    req.speculative = True
    return req


def _run(accepts: callable, steps: int, step_cost: float | None = None) -> list[int]:
    """Steps at which the row drafted, with `accepts(step)` of its K drafts landing; with
    step_cost, each of its verify steps (alone in the batch) takes that many plain steps."""
    policy, req, drafted = Speculation(K), _row(), []
    for step in range(steps):
        if policy.speculates(req, step):
            drafted.append(step)
            if step_cost is not None:
                policy.observe_step(0, 1, step_cost * 0.01, 0.01)
            policy.observe(req, K, accepts(step), step)
    return drafted


def test_zero_acceptance_backs_off_to_a_few_verifies_per_thousand_steps() -> None:
    drafted = _run(lambda step: 0, 20_000)
    # the first window stops once K drafts landing in each verify left could not lift it
    # to the floor: after n verifies with K * (WINDOW - n) < MIN_ACCEPTANCE * K * WINDOW
    floor = MIN_ACCEPTANCE * WINDOW_STEPS
    first = next(n for n in range(1, WINDOW_STEPS + 1) if WINDOW_STEPS - n < floor)
    assert drafted[:first] == list(range(first)) and drafted[first] > first
    # then probes of PROBE_STEPS after pauses 64, 128, ... capped at MAX_PAUSE_STEPS, each
    # starting on the grid of PAUSE_STEPS (so rows paused at other steps probe with it)
    pairs = [(a, b) for a, b in zip(drafted, drafted[1:], strict=False) if b - a > 1]
    want = [min(PAUSE_STEPS * 2**i, MAX_PAUSE_STEPS) for i in range(len(pairs))]
    assert len(pairs) > 5
    for (last, probe), pause in zip(pairs, want, strict=True):
        assert probe % PAUSE_STEPS == 0 and pause <= probe - last < pause + PAUSE_STEPS
    assert len(drafted) < 0.01 * 20_000  # verify steps are under 1% of the row's steps


def _grid(step: int) -> int:
    """The first probe step on the shared grid at or after `step`."""
    return -(-step // PAUSE_STEPS) * PAUSE_STEPS


def test_rows_paused_at_different_steps_probe_together() -> None:
    """Rows that started decoding (and so paused) at different steps probe in the same
    step, one verify step for all of them; once verifies are measured not to pay, a new
    row's first verify waits for that step too."""
    policy = Speculation(K)
    rows = [_row(f"r{i}") for i in range(3)]
    probes: dict[str, list[int]] = {r.request_id: [] for r in rows}
    for step in range(400):
        for i, req in enumerate(rows):
            if step >= 5 * i and policy.speculates(req, step):  # row i starts at step 5i
                if step > 5 * i + WINDOW_STEPS:
                    probes[req.request_id].append(step)
                policy.observe(req, K, 0, step)
    assert probes["r0"] and probes["r0"] == probes["r1"] == probes["r2"]
    for _ in range(COST_SAMPLES):  # a verify costs 3.5 plain steps: no K drafts repay it
        policy.observe_step(0, 1, 0.035, 0.01)
    late = _row("late")
    assert not policy.speculates(late, 401) and policy.speculates(late, _grid(401))


def test_rows_that_start_where_drafts_land_nowhere_are_judged_on_a_probe() -> None:
    """64 rows start together and no draft lands: once every row's verifies together
    fall short, each row's first ones are judged as a probe is (PROBE_STEPS), not on a
    full window (WINDOW_STEPS); a row whose drafts do land among them keeps drafting."""
    policy = Speculation(K)
    rows = [_row(f"r{i}") for i in range(64)]
    drafted: dict[str, list[int]] = {r.request_id: [] for r in rows}
    for step in range(PAUSE_STEPS):
        for req in rows:
            if policy.speculates(req, step):
                drafted[req.request_id].append(step)
                policy.observe(req, K, K if req.request_id == "r63" else 0, step)
    assert drafted["r63"] == list(range(PAUSE_STEPS))
    assert all(drafted[f"r{i}"] == list(range(PROBE_STEPS)) for i in range(63))
    assert policy._recent_accepted == sum(policy._recent)  # kept through the evictions
    alone = _run(lambda step: 0, PAUSE_STEPS)  # a row alone has only its own window
    assert len(alone) > PROBE_STEPS


def test_landing_drafts_keep_the_row_drafting() -> None:
    assert len(_run(lambda step: K, 500)) == 500
    assert len(_run(lambda step: 1, 500)) == 500  # 50% >= the 30% floor


def test_a_probe_that_lands_ends_the_back_off() -> None:
    """Drafts fail for a while, then land: after the first good probe the row drafts
    every step again, and a later failure pauses for PAUSE_STEPS, not a doubled pause."""
    good_from = 400

    drafted = _run(lambda step: K if step >= good_from else 0, 3_000)
    after = [s for s in drafted if s >= good_from]
    first = after[0]
    assert after == list(range(first, 3_000))  # drafts from the first probe on
    assert first < good_from + 2 * MAX_PAUSE_STEPS
    policy, req = Speculation(K), _row()
    step = 0
    while policy.speculates(req, step):  # fail: pause PAUSE_STEPS, then probe
        policy.observe(req, K, 0, step)
        step += 1
    probe = _grid(step - 1 + PAUSE_STEPS)
    for step in range(probe, probe + PROBE_STEPS):  # the probe lands
        assert policy.speculates(req, step)
        policy.observe(req, K, K, step)
    step = probe + PROBE_STEPS
    while policy.speculates(req, step):  # then the drafts fail until the row pauses
        policy.observe(req, K, 0, step)
        step += 1
    failed = step - 1  # the verify that paused it: a fresh PAUSE_STEPS, not doubled
    assert not policy.speculates(req, _grid(failed + PAUSE_STEPS) - 1)
    assert policy.speculates(req, _grid(failed + PAUSE_STEPS))


def test_the_break_even_is_what_a_verify_costs() -> None:
    """No timed verify: no break-even (the floor applies). Timed: the extra time of the
    verifies over their rows' plain tokens, weighted by rows (one verifying row among 15
    plain ones adding 10% to the step owes 1.6 accepted drafts)."""
    policy = Speculation(K)
    for _ in range(COST_SAMPLES - 1):
        policy.observe_step(15, 1, 0.011, 0.010)
    assert policy.break_even() is None
    policy.observe_step(15, 1, 0.011, 0.010)
    assert abs(policy.break_even() - 1.6) < 1e-9
    cheap = Speculation(K)
    for _ in range(COST_SAMPLES):
        cheap.observe_step(0, 8, 0.009, 0.010)  # faster than plain: never a loss
    assert cheap.break_even() == 0.0


def test_one_slow_verify_step_does_not_price_the_others() -> None:
    """A timed verify step that waited on something else (a first-use kernel build, the
    GIL) is one sample of the weighted median: three verifies adding 20% of a plain
    step beside one that took 50x as long still owe 0.2 drafts (a ratio of sums made
    it ~12.4, more than K drafts repay: the row would pause); steps weigh by their
    verifying rows' plain time, so a step of 8 verifying rows outweighs 7 steps of one
    verifying row beside 7 plain ones."""
    policy = Speculation(K)
    for _ in range(COST_SAMPLES - 1):
        policy.observe_step(0, 1, 0.012, 0.010)
    policy.observe_step(0, 1, 0.5, 0.010)
    assert policy.break_even() == pytest.approx(0.2)
    weighted = Speculation(K)
    for _ in range(7):
        weighted.observe_step(7, 1, 0.0125, 0.010)  # 2 drafts a verify, 1 row of 8
    weighted.observe_step(0, 8, 0.014, 0.010)  # 0.4 drafts a verify, 8 rows of 8
    assert weighted.break_even() == pytest.approx(0.4)


def test_a_verify_that_costs_more_than_its_drafts_gain_backs_off() -> None:
    """A verify costing 3.5 plain steps (a CPU's figure): even with every one of K = 2
    drafts landing (3 tokens a verify) speculation loses, so the row backs off as at 0%;
    costing 1.2 plain steps, a row landing 1 of 2 keeps drafting."""
    drafted = _run(lambda step: K, 5_000, step_cost=3.5)
    assert len(drafted) < 0.02 * 5_000
    assert len(_run(lambda step: 1, 500, step_cost=1.2)) == 500


def test_a_cheap_verify_keeps_low_acceptance_rows_drafting() -> None:
    """Below the 30% floor (1 of 4 verifies lands one draft: 12.5%) a row stops while
    the verify's cost is unknown, but keeps drafting where a verify costs 1.05 plain
    steps (0.25 accepted drafts a verify > 0.05)."""

    def one_in_four(step: int) -> int:
        return 1 if step % 4 == 0 else 0

    assert len(_run(one_in_four, 500)) < 500
    assert len(_run(one_in_four, 500, step_cost=1.05)) == 500
