"""Helpers for tests that drive the scheduler without a runner."""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.engine.plan import StepPlan, StepResult


def sampled(plan: StepPlan, tokens: Sequence[int] | int = 7) -> StepResult:
    """What a runner would read back for `plan`: `tokens` (one per sampling row, or one
    token for every row), no logprobs."""
    rows = plan.sample_row_ids
    ids = [tokens] * len(rows) if isinstance(tokens, int) else list(tokens)
    return StepResult(plan.step, rows, tuple(ids), (None,) * len(rows))
