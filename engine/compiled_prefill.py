"""A group of fresh prompts' first chunk as one compiled forward: tokens in, each row's
row state and last hidden state out.

On the GPU a prompt chunk's eager forward costs its op count, not its tokens: built op by
op, ~20 layers' norms, projections, rotary, attention and DeltaNet cores are hundreds of
graph nodes and kernel launches whatever the chunk's length, so a step that adds a prompt
to the decoding rows cost several decode steps (bench/README.md). Traced once per bucketed
shape and replayed (as engine/decode.py does for the decode batch), it costs a handful of
Python operations and fused kernels.

Only first chunks (no state yet), text-only and without a prefix-cache snapshot inside
take this path (`applies`): their state starts at zero, so the trace needs no state inputs,
and every other chunk keeps the eager path. Rows are left-padded to a bucketed length and
the pad counts are data ([P] int32, ForwardGroup.left_pad as an array), so one trace serves
every mix of prompt lengths in its bucket; dead rows fill the rows' bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore, with_headroom
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.decode import SSMView
from deltaserve.engine.shapes import MAX_ROWS, prompt_bucket
from deltaserve.models.qwen35 import Qwen35Model
from deltaserve.models.state import ForwardGroup


class FreshKV:
    """AttentionState of fresh rows inside the trace: the chunk's encoded K/V become the
    rows' stored arrays; queries attend causally, never to a row's padding."""

    def __init__(self, store: KVStore, left_pad: mx.array) -> None:
        self.store = store  # its encoding and attention only; never mutated here
        self.left_pad = left_pad  # [P] int32
        self.arrays: list[mx.array] = []  # each [P, Hkv, L, X] after attend

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        left_pad: object,
    ) -> mx.array:
        """keys/values [P, Hkv, L, D]; queries the last Lq <= L positions. A padding
        query sees only itself (a finite row nobody reads), never a row with no key."""
        self.arrays = self.store.encode(keys, values)
        length, asked = keys.shape[2], queries.shape[2]
        cols = mx.arange(length, dtype=mx.int32)[None, None, :]
        rows = mx.arange(length - asked, length, dtype=mx.int32)[None, :, None]
        pad = self.left_pad[:, None, None]
        mask = ((cols >= pad) | (cols == rows)) & (cols <= rows)  # [P, Lq, L]
        return self.store.attend_stored(queries, self.arrays, scale, mask[:, None])


class CompiledPrefill:
    """First chunks of fresh prompts through the whole model, compiled per bucket."""

    def __init__(self, model: Qwen35Model, max_area: int = 1 << 30) -> None:
        """max_area: the most padded tokens (rows x length bucket) one call runs: the
        runner splits larger cohorts (`cohort_splits`); the engine sets its chunk size."""
        self.model = model
        self.max_area = max_area
        self.shapes: set[tuple[int, int]] = set()  # the buckets run so far (traced)
        self._fn = mx.compile(self._forward)
        self._stores: list[KVStore | SSMState] = []  # the layers of the traced call
        self._arity: list[int] = []  # arrays per KV layer, recorded by the first trace

    @staticmethod
    def applies(state: BatchState, rows: int) -> bool:
        """Whether `rows` fresh rows of this state's kinds can take the compiled path
        (every KV store a KVStore: kv_cache.start's PrefixKV has no traced form)."""
        kinds = all(isinstance(layer, KVStore | SSMState) for layer in state.layers)
        return kinds and 0 < rows <= MAX_ROWS

    def __call__(
        self, prompts: Sequence[Sequence[int]], template: BatchState
    ) -> tuple[mx.array, list[BatchState]]:
        """Each prompt's tokens from position 0 -> ([P, 1, H] final-normed hidden state of
        each prompt's last token, one B=1 BatchState per prompt holding its row state
        exactly as an eager forward of that prompt alone leaves it). `template`: a fresh
        state of this engine's layer kinds (read for their kinds and encodings)."""
        rows = len(prompts)
        ids, pads = prompt_block(prompts)
        self.shapes.add(tuple(ids.shape))
        self._stores = template.layers
        hidden, *flat = self._fn(ids, mx.array(pads, dtype=mx.int32))
        return hidden[:rows], fresh_states(flat, pads[:rows], ids.shape[1], template, self._arity)

    def _forward(self, tokens: mx.array, left_pad: mx.array) -> list[mx.array]:
        """The traced body: the model over fresh views; returns the last hidden state
        followed by every layer's arrays (KV: encoded [P, Hkv, L, X]; DeltaNet: conv,
        ssm) in layer order."""
        views: list[FreshKV | SSMView] = [
            FreshKV(s, left_pad) if isinstance(s, KVStore) else SSMView(None, None)
            for s in self._stores
        ]
        length = tokens.shape[1]
        base = mx.arange(length, dtype=mx.int32)[None] - left_pad[:, None]
        positions = mx.broadcast_to(mx.maximum(base, 0)[None], (3, *tokens.shape))
        group = ForwardGroup(tokens, positions, views, left_pad, outputs="last")
        hidden = self.model([group])[0]
        out = [hidden]
        for view in views:
            out += view.arrays if isinstance(view, FreshKV) else [view.conv, view.ssm]
        self._arity = [len(v.arrays) for v in views if isinstance(v, FreshKV)]
        return out


def prompt_block(prompts: Sequence[Sequence[int]]) -> tuple[mx.array, list[int]]:
    """Fresh prompts as their bucketed block (`prompt_bucket`): [rows_b, length_b] int32
    ids, each prompt left-padded, dead rows after them (token 0, all padding but their
    last column, so that no query sees no key), and every row's pad count."""
    rows, longest = len(prompts), max(len(p) for p in prompts)
    rows_b, length_b = prompt_bucket(rows, longest)
    pads = [length_b - len(p) for p in prompts] + [length_b - 1] * (rows_b - rows)
    ids = [[0] * pad + list(p) for pad, p in zip(pads, prompts, strict=False)]
    ids += [[0] * length_b] * (rows_b - rows)
    return mx.array(ids, dtype=mx.int32), pads


def fresh_states(
    flat: Sequence[mx.array],
    pads: Sequence[int],
    length_b: int,
    template: BatchState,
    arity: Sequence[int],
) -> list[BatchState]:
    """One B=1 BatchState per prompt row p < len(pads) from a fresh-prompt forward's
    outputs: `flat` every layer's arrays in layer order (KV: `arity[j]` encoded arrays
    [P, Hkv, length_b, X] for the j-th KV layer; DeltaNet: conv, ssm), row p left-padded
    by pads[p]. Each row's KV keeps its real columns only, with free columns after them
    (with_headroom), as an eager prefill of that prompt alone leaves its store."""
    states = []
    for p, pad in enumerate(pads):
        layers: list[KVStore | SSMState] = []
        rest, counts = list(flat), iter(arity)
        for kind in template.layers:
            if isinstance(kind, KVStore):
                n = next(counts)
                store = kind.empty_like()
                store.arrays = [with_headroom([a[p : p + 1, :, pad:]]) for a in rest[:n]]
                store.left_pad, store.size = [0], length_b - pad
                rest = rest[n:]
                layers.append(store)
            else:
                ssm = SSMState()
                ssm.conv, ssm.ssm = rest[0][p : p + 1], rest[1][p : p + 1]
                rest = rest[2:]
                layers.append(ssm)
        states.append(BatchState(layers))
    return states
