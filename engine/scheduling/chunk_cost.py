"""What a prompt chunk costs on this device, measured once when the engine starts.

On a GPU a prompt chunk's forward costs mostly its kernel launches, whatever its length
(bench/mixed_step.py: the 0.8B shape on an H200 took ~11 ms for 16 tokens and ~18 ms for
256), so a scheduler that pays that fixed cost for a handful of tokens at a time wastes
the device. Two forwards of a scratch row (64 and 1,024 tokens, each after a warm-up
that also compiles their shapes) give the line t(P) = fixed + token * P
(engine/scheduling/step_cost.py's ChunkCost). The engine sizes its default token budget from it
(`ChunkCost.budget_tokens`), and the step-cost model uses it where no chunk can meet the
stall bound (StepCostModel.prefill_allowance). The CPU is not measured: there a chunk
costs its arithmetic, and the online model prices it.
"""

from __future__ import annotations

import time

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.scheduling.step_cost import ChunkCost
from deltaserve.models.build import LoadedModel
from deltaserve.models.state import ForwardGroup, text_positions

LENGTHS = (64, 1024)  # the two chunk lengths measured
RUNS = 3  # timed runs of each, after one that compiles its shapes


def measure_chunk_cost(loaded: LoadedModel, compiled: CompiledPrefill | None = None) -> ChunkCost:
    """Time one fresh row's prefill forward (and its last position's logits) at each of
    LENGTHS, through `compiled` when the engine runs prompts that way: the fastest of RUNS
    after a first that compiles (on the H200 the second run of the 64-token forward still
    took ~37 ms against ~16 ms once warm); the state is thrown away."""
    model, seconds = loaded.model, []
    for length in LENGTHS:
        tokens = mx.full((1, length), 100, mx.int32)
        positions = text_positions([0], length)
        times = []
        for _ in range(1 + RUNS):
            state = BatchState.empty(loaded.config)
            mx.synchronize()
            start = time.perf_counter()
            if compiled is not None and compiled.applies(state, 1):
                hidden, states = compiled([[100] * length], state)
                state = states[0]
            else:
                group = ForwardGroup(tokens, positions, state.layers, outputs="last")
                hidden = model([group])[0]
            arrays = [a for layer in state.layers for a in layer.state_arrays()]
            mx.eval(model.logits(hidden[:, -1]), *arrays)
            mx.synchronize()
            times.append(time.perf_counter() - start)
        seconds.append(min(times[1:]))
    (short, long), (t_short, t_long) = LENGTHS, seconds
    token = max((t_long - t_short) / (long - short), 1e-7)
    return ChunkCost(max(t_short - token * short, 0.0), token)
