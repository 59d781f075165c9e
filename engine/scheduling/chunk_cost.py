"""What a prompt chunk costs on this device, measured once when the engine starts.

On a GPU a prompt chunk's forward costs mostly its kernel launches, whatever its length
(bench/mixed_step.py: the 0.8B shape on an H200 took ~11 ms for 16 tokens and ~18 ms for
256), so a scheduler that pays that fixed cost for a handful of tokens at a time wastes
the device. Two forwards of a scratch row (64 and 1,024 tokens, each after a warm-up
that also compiles their shapes) give the line t(P) = fixed + token * P
(engine/scheduling/step_cost.py's ChunkCost), and a later chunk over the row's state (the
eager path, where a first chunk may run compiled) its own fixed part. The engine sizes its
default token budget from the first line (`ChunkCost.budget_tokens`), and the step-cost
model uses the larger fixed part where no chunk can meet the stall bound
(StepCostModel.prefill_allowance). The CPU is not measured: there a chunk
costs its arithmetic, and the online model prices it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.scheduling.step_cost import ChunkCost
from deltaserve.models.build import LoadedModel
from deltaserve.models.state import ForwardGroup, text_positions

LENGTHS = (64, 1024)  # the two chunk lengths measured
LATER = 64  # a later chunk's length (after a first chunk of LATER tokens)
RUNS = 3  # timed runs of each, after one that compiles its shapes


def measure_chunk_cost(loaded: LoadedModel, compiled: CompiledPrefill | None = None) -> ChunkCost:
    """Time one fresh row's prefill forward (and its last position's logits) at each of
    LENGTHS, through `compiled` when the engine runs prompts that way: the fastest of RUNS
    after a first that compiles (on the H200 the second run of the 64-token forward still
    took ~37 ms against ~16 ms once warm); then a later chunk of LATER tokens over such a
    row's state, eagerly: its fixed part is what a prompt split into small chunks pays for
    each next to decoding rows, where a later chunk runs compiled only at a shape already
    traced (engine/runner.py; H200, 0.8B: 17.0 ms next to 8.9 ms for a compiled first
    chunk). The states are thrown away."""
    seconds = [
        _fastest(lambda: BatchState.empty(loaded.config), loaded, 0, length, compiled)
        for length in LENGTHS
    ]
    (short, long), (t_short, t_long) = LENGTHS, seconds
    token = max((t_long - t_short) / (long - short), 1e-7)

    def started() -> BatchState:
        state = BatchState.empty(loaded.config)
        _forward(loaded, state, 0, LATER, None)
        mx.eval(state.state_arrays())
        return state

    t_later = _fastest(started, loaded, LATER, LATER, None)
    fixed = max(t_short - token * short, 0.0)
    return ChunkCost(fixed, token, max(t_later - token * LATER, 0.0))


def _fastest(
    fresh: Callable[[], BatchState],
    loaded: LoadedModel,
    start: int,
    length: int,
    compiled: CompiledPrefill | None,
) -> float:
    """Seconds of the fastest of RUNS forwards of `length` tokens from `start` (each on
    the state `fresh` returns), after one more that traces and warms its shapes."""
    times = []
    for _ in range(1 + RUNS):
        state = fresh()
        mx.synchronize()
        begin = time.perf_counter()
        _forward(loaded, state, start, length, compiled)
        mx.synchronize()
        times.append(time.perf_counter() - begin)
    return min(times[1:])


def _forward(
    loaded: LoadedModel,
    state: BatchState,
    start: int,
    length: int,
    compiled: CompiledPrefill | None,
) -> None:
    """One row's chunk of `length` tokens at `start` and its last logits, evaluated (the
    row's state advances in `state`): compiled where `compiled` takes it (a first
    chunk), else eager."""
    model = loaded.model
    if start == 0 and compiled is not None and compiled.applies(state, 1):
        hidden, states = compiled([[100] * length], state)
        state = states[0]
    else:
        tokens = mx.full((1, length), 100, mx.int32)
        group = ForwardGroup(tokens, text_positions([start], length), state.layers, outputs="last")
        hidden = model([group])[0]
    arrays = state.state_arrays()
    mx.eval(model.logits(hidden[:, -1]), *arrays)
