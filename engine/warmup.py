"""Tracing the compiled paths' common shapes before the first request, within a time limit.

A compiled step (engine/decode.py, engine/compiled_prefill.py) is traced, and its kernels
JIT-compiled, the first time each bucketed shape runs. Left to the first busy minute, that
lands on the requests of that minute: a fresh server's first 16 concurrent chats waited
behind one new trace after another (H200, 0.8B: TTFT p99 5.2 s against p50 0.37 s).
Here the engine runs them at start, in the order `_shapes` gives: the decode batch at
each row bucket up to max_num_seqs (first KV capacity), fresh prompts alone at each
length bucket up to a chunk, the decode batch at two more capacities, with the packed
mixed step (engine/packed_step.py) each prompt length bucket beside each row bucket,
with speculation the verify batch at each row bucket and the MTP head's draft chain
(each row bucket, each number of pairs a row brings), then cohorts of several prompts
(every bucket the runner runs, the smaller first), and with compiled later chunks a
long prompt's second and third full chunk. What the time limit leaves out traces on
first use, except a prompt shape (fresh prompts, later chunks): that runs eagerly until
a step of one prompt chunk and no row decoding meets it (engine/runner.py
`_may_trace`). First of all the sampler draws once each way (greedy, top-k, top-p,
plain, with logprobs): its kernels are built on first use too (H100, a fresh machine:
the first decode step took 4.1 s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import FullPrecisionKV
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.packed_step import PackedMixedStep
from deltaserve.engine.sampling.sampler import Sampler, SamplingRow
from deltaserve.engine.shapes import MAX_ROWS, decode_bucket, prompt_bucket
from deltaserve.engine.speculative import CompiledDraft, chain_width
from deltaserve.engine.types import SamplingParams
from deltaserve.models.state import ForwardGroup, text_positions

log = logging.getLogger(__name__)

# Rows' lengths the decode batch is warmed at: one per KV capacity step (engine/cache/kv.py
# round_capacity: 256 columns at a time up to 2,048, each capacity a new trace): chats
# of up to ~750 tokens of prompt and answer (H200, 0.8B: each trace ~0.4 s, and a batch
# takes its longest row's capacity, so a missing one stalls every row)
DECODE_TOKENS = (16, 300, 600)


def prompt_lengths(max_chunk: int) -> list[int]:
    """One length per prompt bucket up to `max_chunk` tokens (its largest member)."""
    lengths, n = [], 1
    while True:
        bucket = prompt_bucket(1, n)[1]
        lengths.append(min(bucket, max_chunk))
        if bucket >= max_chunk:
            return lengths
        n = bucket + 1


def decode_sizes(max_rows: int) -> list[int]:
    """The decode batch's bucket sizes up to max_rows (engine/cache/rows.py)."""
    sizes, n = [], 1
    while n <= max_rows:
        size = decode_bucket(n, max_rows)
        sizes.append(size)
        n = size + 1
    return sizes


def warm_up(
    new_state: Callable[[], BatchState],
    prompts: CompiledPrefill | None,
    decode: CompiledDecode | None,
    max_chunk: int,
    max_rows: int,
    seconds: float,
    verify_columns: int = 0,
    chunks: bool = False,
    sampler: tuple[Sampler, int] | None = None,
    drafts: CompiledDraft | None = None,
    packed: PackedMixedStep | None = None,
) -> int:
    """Run each shape of `_shapes` until `seconds` have passed; returns how many ran. The
    states are thrown away. verify_columns: a speculative verify's k + 1 (0: none);
    chunks: later chunks run through `decode`'s chunk forward; sampler: the engine's
    sampler and the vocabulary size, to draw with first (`_draws`); drafts: the MTP
    head's compiled draft chain (speculation on a GPU), traced after the verify batch;
    packed: the packed mixed step (pack_token_wise on a GPU), traced after the decode
    batch's capacities."""
    start, done = time.perf_counter(), 0
    if sampler is not None:
        _draws(*sampler)
    shapes = _shapes(
        new_state, prompts, decode, max_chunk, max_rows, verify_columns, chunks, drafts, packed
    )
    for run in shapes:
        if time.perf_counter() - start > seconds:
            break
        run()
        done += 1
    log.info(
        "warm-up: %d compiled shapes traced in %.1f s (the rest on first use)",
        done,
        time.perf_counter() - start,
    )
    return done


# One of each way the sampler draws (engine/sampling/sampler.py's kinds), and logprobs
WARM_DRAWS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.0, logprobs=True, top_logprobs=2),
)


def _draws(sampler: Sampler, vocab: int) -> None:
    """The sampler draws from random logits alone in each way and all together, and the
    tokens are read back (as a step does)."""
    logits = mx.random.normal((len(WARM_DRAWS), vocab), key=mx.random.key(0))
    rows = [SamplingRow(p, (100,), ()) for p in WARM_DRAWS]
    for i, row in enumerate(rows):
        sampler.sample(logits[i : i + 1], [row]).to_python([row])
    sampler.sample(logits, rows).to_python(rows)


def _shapes(
    new_state: Callable[[], BatchState],
    prompts: CompiledPrefill | None,
    decode: CompiledDecode | None,
    max_chunk: int,
    max_rows: int,
    verify_columns: int = 0,
    chunks: bool = False,
    drafts: CompiledDraft | None = None,
    packed: PackedMixedStep | None = None,
) -> Iterator[Callable[[], None]]:
    """Runs of one shape each, those a missing trace costs most first: the decode batch
    at its first KV capacity (a decode shape traces on first use, a stall of every
    stream), fresh prompts alone (a lone prompt's shape traces in its own step, a stall
    of that request), the decode batch's next capacities, the packed mixed step (each
    row bucket beside one fresh prompt of each length bucket, at the first capacity: a
    new pair traces its layer kinds, not the model), the verify batch and its draft
    chain (every number of pairs a row brings, 1 .. k + 1); then the shapes that run
    eagerly until traced (runner `_may_trace`): cohorts, later chunks. A fresh CUDA
    machine traced 8 shapes in 68 s (H100, 0.8B: each builds its kernels)."""
    lengths = prompt_lengths(max_chunk)
    decodes = decode is not None and CompiledDecode.supports(new_state())
    for tokens in DECODE_TOKENS[:1] if decodes else ():
        for rows in decode_sizes(max_rows):
            yield lambda rows=rows, tokens=tokens: _decode(decode, new_state, rows, tokens)
    if prompts is not None and prompts.applies(new_state(), 1):
        for length in lengths:
            yield lambda length=length: _prompts(prompts, new_state, 1, length)
    if decodes:
        for tokens in DECODE_TOKENS[1:]:
            for rows in decode_sizes(max_rows):
                yield lambda rows=rows, tokens=tokens: _decode(decode, new_state, rows, tokens)
        can_pack = packed is not None and prompts is not None and prompts.applies(new_state(), 1)
        for length in lengths if can_pack else ():  # the shorter (cheaper, commoner) first
            for rows in decode_sizes(max_rows):
                yield lambda rows=rows, length=length: _packed(
                    packed, decode, new_state, rows, length
                )
        for rows in decode_sizes(max_rows) if verify_columns else ():
            yield lambda rows=rows: _decode(
                decode, new_state, rows, DECODE_TOKENS[0], verify_columns
            )
    for rows in decode_sizes(max_rows) if drafts is not None and verify_columns else ():
        widths = {chain_width(rows, w, verify_columns) for w in range(1, verify_columns + 1)}
        for width in sorted(widths):
            yield lambda rows=rows, width=width: _draft(drafts, rows, DECODE_TOKENS[0], width)
    if prompts is not None and prompts.applies(new_state(), 1):
        for rows, length in cohort_shapes(max_chunk, max_rows):
            yield lambda rows=rows, length=length: _prompts(prompts, new_state, rows, length)
    if chunks and decode is not None and CompiledDecode.supports(new_state()):
        for start in (max_chunk, 2 * max_chunk):
            yield lambda start=start: _chunk(decode, new_state, start, max_chunk)


def cohort_shapes(max_chunk: int, max_rows: int) -> list[tuple[int, int]]:
    """The [rows, length] buckets of cohorts of 2 or more fresh prompts, the smaller
    first: those of at most `max_chunk` padded tokens, the only ones the runner runs
    (shapes.cohort_splits splits a larger cohort)."""
    shapes, rows = set(), 2
    while rows <= min(MAX_ROWS, max_rows):
        for length in prompt_lengths(max_chunk):
            rows_b, length_b = prompt_bucket(rows, length)
            if rows_b * length_b <= max_chunk:
                shapes.add((rows, length))
        rows *= 2
    return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape))


def _prompts(
    prompts: CompiledPrefill, new_state: Callable[[], BatchState], rows: int, length: int
) -> None:
    hidden, states = prompts([[100] * length] * rows, new_state())
    mx.eval(hidden, *[a for s in states for a in s.state_arrays()])


def _holding(
    decode: CompiledDecode, new_state: Callable[[], BatchState], length: int
) -> BatchState:
    """A one-row state that holds `length` tokens (lazy: the caller's eval computes it)."""
    state = new_state()
    tokens = mx.full((1, length), 100, mx.int32)
    group = ForwardGroup(tokens, text_positions([0], length), state.layers, outputs="none")
    decode.model([group])
    return state


def _chunk(
    decode: CompiledDecode, new_state: Callable[[], BatchState], start: int, length: int
) -> None:
    """A later chunk of `length` tokens over a row that holds `start`."""
    state = _holding(decode, new_state, start)
    hidden = decode.chunk([[100] * length], [start], state)
    mx.eval(hidden, *state.state_arrays())


def _decode(
    decode: CompiledDecode,
    new_state: Callable[[], BatchState],
    rows: int,
    length: int,
    verify_columns: int = 0,
) -> None:
    """A decode step of `rows` rows of `length` tokens each (its KV capacity bucket), or
    with verify_columns a speculative verify of that many columns per row."""
    state = _holding(decode, new_state, length)
    for _ in range(rows - 1):
        state.merge(state.extract(0))
    if verify_columns:
        out = decode.verify(mx.zeros((rows, verify_columns), mx.int32), [length] * rows, state)
    else:
        out = (decode(mx.zeros((rows, 1), mx.int32), [length] * rows, state),)
    mx.eval(*out, *state.state_arrays())


def _packed(
    packed: PackedMixedStep,
    decode: CompiledDecode,
    new_state: Callable[[], BatchState],
    rows: int,
    length: int,
) -> None:
    """The packed mixed step: `rows` decode rows at the first KV capacity beside one
    fresh prompt of `length` tokens."""
    state = _holding(decode, new_state, DECODE_TOKENS[0])
    for _ in range(rows - 1):
        state.merge(state.extract(0))
    tokens = mx.zeros((rows, 1), mx.int32)
    offsets = [DECODE_TOKENS[0]] * rows
    logits, [(hidden, states)] = packed(tokens, offsets, state, [[[100] * length]], new_state())
    mx.eval(logits, hidden, *state.state_arrays(), *states[0].state_arrays())


def _draft(drafts: CompiledDraft, rows: int, length: int, width: int) -> None:
    """The head's compiled draft chain for `rows` rows bringing `width` pairs each, over
    head stores that hold `length` pairs (their first capacity)."""
    model = drafts.model
    store = FullPrecisionKV()
    tokens = mx.full((rows, length), 100, mx.int32)
    embeds = model.embed_tokens(tokens)
    hidden = mx.zeros(embeds.shape, embeds.dtype)
    drafts.head(embeds, hidden, text_positions([0] * rows, length), store, last_only=True)
    positions = text_positions([length] * rows, width)
    out = drafts(hidden[:, :width], tokens[:, :width], positions, [0] * rows, store)
    mx.eval(out, *store.state_arrays())
