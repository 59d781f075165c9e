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
(StepCostModel.prefill_allowance). Where mixed steps run packed (engine/packed_step.py:
the decode rows and fresh prompts share each weight's matmul), each first chunk runs
beside a decoding row and the line is what the chunk adds to that row's step: a large model's
chunk then no longer pays a second pass over the weights. The CPU is not measured: there
a chunk costs its arithmetic, and the online model prices it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.packed_step import PackedMixedStep
from deltaserve.engine.scheduling.step_cost import ChunkCost
from deltaserve.models.build import LoadedModel
from deltaserve.models.state import ForwardGroup, text_positions

LENGTHS = (64, 1024)  # the two chunk lengths measured
LATER = 64  # a later chunk's length (after a first chunk of LATER tokens)
RUNS = 3  # timed runs of each, after one that compiles its shapes


def measure_chunk_cost(
    loaded: LoadedModel,
    compiled: CompiledPrefill | None = None,
    packed: tuple[CompiledDecode, PackedMixedStep] | None = None,
) -> ChunkCost:
    """Time one fresh row's prefill forward (and its last position's logits) at each of
    LENGTHS, through `compiled` when the engine runs prompts that way: the fastest of RUNS
    after a first that compiles (on the H200 the second run of the 64-token forward still
    took ~37 ms against ~16 ms once warm); then a later chunk of LATER tokens over such a
    row's state, eagerly: its fixed part is what a prompt split into small chunks pays for
    each next to decoding rows, where a later chunk runs compiled only at a shape already
    traced (engine/runner.py; H200, 0.8B: 17.0 ms next to 8.9 ms for a compiled first
    chunk). `packed` (the compiled decode step and the packed mixed step: fresh prompts
    run packed beside decoding rows): each first chunk runs through the packed step
    beside a decoding row's next token, less what that token costs through the decode
    step a decode-only step runs. The states are thrown away."""
    row, alone = None, 0.0
    if packed is not None:
        row = _decoding_row(loaded)
        alone = _fastest(lambda: _decode(packed[0], row))
    step = packed[1] if packed is not None else None

    def chunk(start: int, length: int, via: CompiledPrefill | None) -> float:
        beside = row if start == 0 else None  # a later chunk runs apart from the rows

        def run() -> Callable[[], None]:
            state = BatchState.empty(loaded.config)
            if start:
                _forward(loaded, state, 0, start, None)
            mx.synchronize()
            return lambda: _forward(loaded, state, start, length, via, beside, step)

        return _fastest(run, prepared=True) - (alone if beside is not None else 0.0)

    t_short, t_long = (chunk(0, length, compiled) for length in LENGTHS)
    short, long = LENGTHS
    token = max((t_long - t_short) / (long - short), 1e-7)
    t_later = chunk(LATER, LATER, None)
    fixed = max(t_short - token * short, 0.0)
    return ChunkCost(fixed, token, max(t_later - token * LATER, 0.0), packed is not None)


def _decoding_row(loaded: LoadedModel) -> BatchState:
    """A B=1 row state after a LATER-token prompt: the decoding row a packed chunk runs
    beside (its state advances with each run)."""
    state = BatchState.empty(loaded.config)
    _forward(loaded, state, 0, LATER, None)
    return state


def _decode(decode: CompiledDecode, row: BatchState) -> None:
    """The row's next token through the compiled decode step, evaluated."""
    offset = _size(row)
    logits = decode(mx.full((1, 1), 100, mx.int32), [offset], row)
    mx.eval(logits, *row.state_arrays())


def _size(row: BatchState) -> int:
    """The row's tokens so far (its KV stores' columns)."""
    return next((layer.size for layer in row.layers if isinstance(layer, KVStore)), LATER)


def _fastest(run: Callable[[], object], prepared: bool = False) -> float:
    """Seconds of the fastest of RUNS calls of `run`, after one more that traces and warms
    its shapes; `prepared`: `run` sets up untimed and returns the call to time."""
    times = []
    for _ in range(1 + RUNS):
        timed = run() if prepared else run
        mx.synchronize()
        begin = time.perf_counter()
        timed()
        mx.synchronize()
        times.append(time.perf_counter() - begin)
    return min(times[1:])


def _forward(
    loaded: LoadedModel,
    state: BatchState,
    start: int,
    length: int,
    compiled: CompiledPrefill | None,
    beside: BatchState | None = None,
    packed: PackedMixedStep | None = None,
) -> None:
    """One row's chunk of `length` tokens at `start` and its last logits, evaluated (the
    row's state advances in `state`): compiled where `compiled` takes it (a first
    chunk), else eager; with `beside` and `packed`, a first chunk through the packed step
    with that row's next decode token (its state advances too)."""
    model = loaded.model
    if start == 0 and beside is not None and packed is not None:
        tokens = mx.full((1, 1), 100, mx.int32)
        logits, [(hidden, states)] = packed(
            tokens, [_size(beside)], beside, [[[100] * length]], state
        )
        mx.eval(logits, model.logits(hidden[:, -1]), *beside.state_arrays())
        mx.eval(*states[0].state_arrays())
        return
    if start == 0 and compiled is not None and compiled.applies(state, 1):
        hidden, states = compiled([[100] * length], state)
        mx.eval(model.logits(hidden[:, -1]), *states[0].state_arrays())
        return
    tokens = mx.full((1, length), 100, mx.int32)
    positions = text_positions([start], length)
    hidden = model([ForwardGroup(tokens, positions, state.layers, outputs="last")])
    mx.eval(model.logits(hidden[0][:, -1]), *state.state_arrays())
