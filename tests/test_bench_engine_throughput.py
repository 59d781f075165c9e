"""bench.engine_throughput's `throughput` (bench.gpu's in-process figure): its warm-up
run meets every compiled shape the measured run does, on the one engine both share, so
the measured run traces none (a fresh engine would trace them inside the timing); and
`steady` runs it again while a measured run did trace. Figures only; no time is
asserted."""

from __future__ import annotations

import pytest

import bench.engine_throughput as et
from bench.engine_throughput import Ours, throughput
from deltaserve.engine.engine import LLMEngine
from deltaserve.models.testing import cached_checkpoint


def test_the_measured_run_traces_no_compiled_shape() -> None:
    ours = Ours(str(cached_checkpoint("tiny")), 256, 128, pack=False, compile_decode=True)
    traced: list[int] = []
    run = ours.run

    def count(engine: LLMEngine | None) -> int:
        return engine.scheduler.step_times.snapshot().traced if engine is not None else 0

    def counted(prompts: list[list[int]], gens: list[int], on_token) -> None:
        engine, before = ours.engine, count(ours.engine)
        run(prompts, gens, on_token)
        traced.append(count(ours.engine) - (before if ours.engine is engine else 0))

    ours.run = counted  # type: ignore[method-assign]
    row = throughput(ours, 4, 24, 24, 16, 40)
    assert row["tokens"] == 4 * 24
    warm, measured = traced
    assert warm > 0 and measured == 0  # the compiled decode was traced, in the warm-up only
    # the row says what the measured run's steps were, its own traces counted the same way
    assert row["traced"] == measured
    assert row["steps"]["decode"]["n"] >= 23 and row["steps"]["decode"]["mean_ms"] > 0


@pytest.mark.parametrize(
    ("traced", "runs"), [([0, 0, 0], 1), ([2, 0, 0], 2), ([1, 1, 1], 3), ([3, 3, 3, 0], 3)]
)
@pytest.mark.parametrize("shift", [True, False])
def test_steady_repeats_while_the_measured_run_traced(
    monkeypatch: pytest.MonkeyPatch, traced: list[int], runs: int, shift: bool
) -> None:
    """Again while the measured run traced, at most RUNS times, each repeat on prompt
    tokens of its own unless `shift` is off (bench.speculative's repeats keep theirs)."""
    shifts: list[int] = []

    def fake(impl: object, *shape: int, shift: int = 0) -> dict:
        shifts.append(shift)
        return {"tok_s": 1.0, "traced": traced[len(shifts) - 1]}

    monkeypatch.setattr(et, "throughput", fake)
    row = et.steady(object(), (64, 128, 128, 108, 108), shift=shift)
    assert et.RUNS == 3 and row["runs"] == runs and row["traced"] == traced[runs - 1]
    assert shifts == (list(range(runs)) if shift else [0] * runs)
