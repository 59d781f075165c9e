"""engine/scheduling/chunk_cost.py: the start-up measurement of what a prompt chunk costs (run by
the engine on a GPU; here on the CPU's tiny checkpoint, for its contract)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.scheduling.chunk_cost import measure_chunk_cost
from deltaserve.models.build import load_model
from deltaserve.models.testing import cached_checkpoint


def test_measures_a_line() -> None:
    """Non-negative fixed parts (first and later chunks), a positive per-token part, a
    budget within bounds; a small chunk is priced at the larger fixed part."""
    loaded = load_model(str(cached_checkpoint("tiny")))
    cost = measure_chunk_cost(loaded)
    assert cost.fixed_seconds >= 0 and cost.later_fixed_seconds >= 0 and cost.token_seconds > 0
    assert cost.split_seconds(16) == pytest.approx(
        max(cost.fixed_seconds, cost.later_fixed_seconds) + 16 * cost.token_seconds
    )
    assert 512 <= cost.budget_tokens() <= 8192


def test_measures_a_packed_line() -> None:
    """Mixed steps packed (engine/packed_step.py, the compiled decode step as the
    baseline): a first chunk through the packed step beside a decoding row, less that
    row's decode step, is a line as well; the row it ran beside advanced a token a run,
    through the packed step for first chunks only (a later chunk runs apart)."""
    from deltaserve.engine.decode import CompiledDecode
    from deltaserve.engine.packed_step import PackedMixedStep

    loaded = load_model(str(cached_checkpoint("tiny")))
    calls: list[list[int]] = []
    packed_calls: list[tuple[list[int], int]] = []

    class Counting(CompiledDecode):
        def __call__(self, tokens: mx.array, offsets: list[int], state: object) -> mx.array:
            calls.append(list(offsets))
            return super().__call__(tokens, offsets, state)

    class CountingPacked(PackedMixedStep):
        def __call__(self, *args: Any) -> tuple[mx.array, list[tuple[mx.array, list]]]:
            _, offsets, _, blocks, _ = args
            packed_calls.append((list(offsets), len(blocks[0][0])))
            return super().__call__(*args)

    pair = (Counting(loaded.model), CountingPacked(loaded.model))
    cost = measure_chunk_cost(loaded, None, pair)
    assert cost.fixed_seconds >= 0 and cost.later_fixed_seconds >= 0 and cost.token_seconds > 0
    assert len(calls) == 4 and calls[0] < calls[-1], "the baseline decoded the row, 4 runs"
    # 4 runs of each first-chunk length, after the baseline's: the row's position grows
    assert [n for _, n in packed_calls] == [64] * 4 + [1024] * 4
    positions = [o[0] for o, _ in packed_calls]
    assert positions == sorted(positions) and positions[0] > calls[-1][0]
    assert cost.beside_decode and not measure_chunk_cost(loaded).beside_decode


def test_engine_measures_only_on_a_gpu() -> None:
    """The CPU engine keeps its 512-token defaults and no measured cost."""
    engine = LLMEngine(load_model(str(cached_checkpoint("tiny"))))
    if mx.default_device() == mx.cpu:
        assert engine.chunk_cost is None
        assert engine.config.max_num_batched_tokens == engine.config.max_prefill_chunk == 512
    else:
        assert engine.chunk_cost is not None
        assert engine.config.max_prefill_chunk == engine.chunk_cost.budget_tokens()


def test_the_start_up_log_says_how_the_chunk_was_measured(caplog: pytest.LogCaptureFixture) -> None:
    """The start-up line a GPU logs (here on the CPU's engine, with a measured cost set):
    the chunk's price, and whether it was measured beside decoding rows (packed)."""
    from deltaserve.engine.scheduling.step_cost import ChunkCost

    engine = LLMEngine(load_model(str(cached_checkpoint("tiny"))))
    for beside, said in ((False, "a token here, a later"), (True, "here beside decoding rows")):
        engine.chunk_cost = ChunkCost(0.0101, 2.7e-5, 0.013, beside)
        caplog.clear()
        with caplog.at_level("INFO", logger="deltaserve.engine.engine"):
            engine._log_budget()
        assert "a prompt chunk costs 10.1 ms + 0.027 ms" in caplog.text and said in caplog.text
