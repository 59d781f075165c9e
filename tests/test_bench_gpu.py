"""bench.gpu's `steady`: throughput() again, on other prompt tokens, while its measured
run traced a compiled shape (a one-off a server pays once), at most RUNS times."""

from __future__ import annotations

import pytest

import bench.gpu as gpu


def _fake(traced: list[int], shifts: list[int]):
    def throughput(impl, *shape, shift: int = 0) -> dict:
        shifts.append(shift)
        return {"tok_s": 1.0, "traced": traced[len(shifts) - 1]}

    return throughput


@pytest.mark.parametrize(("traced", "runs"), [([0, 0, 0], 1), ([2, 0, 0], 2), ([1, 1, 1], 3)])
def test_steady_repeats_while_the_measured_run_traced(
    monkeypatch: pytest.MonkeyPatch, traced: list[int], runs: int
) -> None:
    shifts: list[int] = []
    monkeypatch.setattr(gpu, "throughput", _fake(traced, shifts))
    row = gpu.steady(object(), (64, 128, 128, 108, 108))
    assert row["runs"] == runs and row["traced"] == traced[runs - 1]
    assert shifts == list(range(runs))  # each repeat on prompts of its own
