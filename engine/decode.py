"""The decode step as one compiled function: tokens and row state in, logits and state out.

On the GPU a decode step is launch- and Python-bound: the 0.8B shape at B=64 spent ~19 ms
of a ~20 ms step building and submitting ~1,000 small ops for ~1 ms of GPU work. Here the
whole decode forward (embedding, every layer, final norm, LM head) is traced once per
input shape by mx.compile and replayed: a step costs a handful of Python operations.

The traced function is pure. Each layer's stored arrays go in and come out as values:
KV stores write the step's column with slice_update at `size` (an array, so the write
position is data, not a Python constant baked into the trace) and attend over their whole
capacity with a mask built from arrays; DeltaNet conv and recurrent state are replaced.
Shapes change only when the batch crosses a bucket size (RowStates holds it at 1, 2, 4,
8, 12, 16, 24, ... rows) or a store grows past a multiple of its capacity step
(engine/cache/kv.py), so few traces exist.

A speculative verify (engine/speculative.py) is the same step over k + 1 columns per row
(each row's last token and its drafts) that also keeps the DeltaNet state after every
column (ForwardGroup.state_slots): `verify` runs it as a second traced function, so on the
GPU a verify costs about what a decode step does, not an eager forward's op count.

A prompt's later chunk (rows that hold state take their next prompt tokens: a prompt
longer than a chunk, or the rest of a prompt after a prefix-cache hit) is the same forward
over a left-padded, bucketed [P, L] block that keeps only the last position's hidden
state: `chunk` runs it as a third traced function, for one row or several rows' chunks of
any lengths (their padding joins each row's KV left pad). On the H200 a step costs about its
kernel launches, and compiled a 256-token later chunk launches ~40% fewer than eagerly
(0.8B: `bench.step_kernels`, bench/README.md).

Supported row state: every KVStore kind (full precision, affine, TurboQuant). PrefixKV
(kv_cache.start > 0) keeps the uncompiled path; `supports` says which applies.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.shapes import chunk_bucket, chunk_capacity
from deltaserve.models.qwen35 import Qwen35Model
from deltaserve.models.state import ForwardGroup


class KVView:
    """AttentionState over a KVStore's arrays inside a trace (writes new arrays); here,
    and for the MTP head's store in engine/speculative.py's compiled draft."""

    def __init__(
        self,
        store: KVStore,
        arrays: list[mx.array],
        left_pad: mx.array,
        size: mx.array,
        moved: mx.array | None = None,
    ) -> None:
        """left_pad: each row's padding columns after this call's first write; moved:
        how far that write's padding shifts each row's stored tokens right (KVStore.store
        for a left-padded block after real tokens), None: not at all."""
        self.store = store  # for its encoding and attention only; never mutated here
        self.arrays = arrays  # each [B, Hkv, capacity, X]
        self.left_pad = left_pad  # [B] int32
        self.size = size  # [1] int32: the column the next write starts at
        self.moved = moved  # [B] int32, or None

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        left_pad: tuple[int, ...] | None,
    ) -> mx.array:
        """L new columns per row ([B, Hkv, L, D] K/V, written at `size`); the last of
        the q queries ([B, Hq, q, D], q <= L) attends over columns left_pad[b] .. its own
        (inclusive) of the whole capacity. A first write with `moved` shifts each row's
        stored tokens right over its padding, as KVStore.store does, by one gather."""
        encoded = self.store.encode(keys, values)
        start = mx.concatenate([mx.zeros((2,), mx.int32), self.size, mx.zeros((1,), mx.int32)])
        self.arrays = [
            mx.slice_update(a, n, start, (0, 1, 2, 3))
            for a, n in zip(self.arrays, encoded, strict=True)
        ]
        cols = mx.arange(self.arrays[0].shape[2], dtype=mx.int32)
        if self.moved is not None:
            shift = self.moved[:, None]
            source = mx.where(cols[None] < self.size + shift, cols[None] - shift, cols[None])
            source = mx.maximum(source, 0)[:, None, :, None]  # [B, 1, capacity, 1]
            self.arrays = [mx.take_along_axis(a, source, axis=2) for a in self.arrays]
            self.moved = None
        length, q = keys.shape[2], queries.shape[2]
        last = self.size + (length - q) + mx.arange(q, dtype=mx.int32)  # [q]
        cols = cols[None, None]
        mask = (cols >= self.left_pad[:, None, None]) & (cols <= last[None, :, None])
        self.size = self.size + length
        return self.store.attend_stored(queries, self.arrays, scale, mask[:, None])


class SSMView:
    """RecurrentState inside a trace (here and engine/compiled_prefill.py): the model
    replaces conv and ssm (None: zeros, a fresh row)."""

    def __init__(self, conv: mx.array | None, ssm: mx.array | None) -> None:
        self.conv = conv
        self.ssm = ssm
        self.slots: tuple[mx.array, mx.array] | None = None  # a verify's (state_slots)


class CompiledDecode:
    """Decode forward + logits for the decode batch, the verify forward for the rows that
    speculate, and a prompt's later chunk over its row's state, each compiled per input
    shape."""

    def __init__(self, model: Qwen35Model) -> None:
        self.model = model
        self._fn = mx.compile(self._forward)
        self._verify_fn = mx.compile(self._verify_forward)
        self._chunk_fn = mx.compile(self._chunk_forward)
        self._stores: list[KVStore | SSMState] = []  # the layers of the traced call
        # (verify?, tokens' shape, the KV arrays' shape) of each decode or verify call so
        # far, ("chunk", (rows, bucket), KV capacity) of each chunk call: a new one was
        # traced by that call (the runner reports it with the step)
        self.shapes: set[tuple] = set()

    @staticmethod
    def supports(state: BatchState) -> bool:
        """Whether every layer's store has a traced form (PrefixKV has not)."""
        return all(isinstance(layer, KVStore | SSMState) for layer in state.layers)

    def __call__(self, tokens: mx.array, offsets: Sequence[int], state: BatchState) -> mx.array:
        """tokens [B, 1] int32 (possibly lazy), offsets: each row's rotary position.
        `state` may hold dead rows after the B live ones (a bucketed batch); they run on
        token 0 and are never read. Returns logits [B, V] (float32) and stores the new
        state arrays in `state`."""
        logits, _ = self._run(tokens, offsets, state, verify=False)
        return logits

    def verify(
        self, tokens: mx.array, offsets: Sequence[int] | mx.array, state: BatchState
    ) -> tuple[mx.array, mx.array]:
        """A speculative verify: tokens [B, L] int32 (each row's last token and its
        drafts), offsets each row's first position (a lazy [B] int32 array for a verify
        chained onto one not read back yet); dead rows as in __call__. Returns the
        final-normed hidden states [B, L, H] and logits [B, L, V]; stores the new state
        arrays in `state` with each DeltaNet layer's state after every column as its
        `slots`, as an eager forward with ForwardGroup.state_slots does
        (BatchState.keep_verified reads them)."""
        hidden, logits = self._run(tokens, offsets, state, verify=True)
        assert logits is not None
        return hidden, logits

    @staticmethod
    def chunk_shape(lengths: Sequence[int], columns: int) -> tuple:
        """The traced shape a `chunk` call of rows with these chunk lengths, whose KV
        holds `columns` columns before it (`kv_columns`), runs at (in `shapes` once it has
        run): the bucketed block and the KV capacity it needs."""
        length_b = chunk_bucket(max(lengths))
        return ("chunk", (len(lengths), length_b), chunk_capacity(columns + length_b))

    @staticmethod
    def kv_columns(states: Sequence[BatchState]) -> int:
        """The KV columns of these rows' states as one `chunk` call holds them: one
        state as it is, several merged (RowStates.cohort_state: each row's own padding
        dropped, right edges aligned)."""
        columns = 0
        for state in states:
            kv = next((s for s in state.layers if isinstance(s, KVStore)), None)
            if kv is not None:
                pad = min(kv.left_pad, default=0) if len(states) > 1 else 0
                columns = max(columns, kv.size - pad)
        return columns

    def chunk(
        self, prompts: Sequence[Sequence[int]], starts: Sequence[int], state: BatchState
    ) -> mx.array:
        """Rows holding state take their next prompt tokens: row p's `prompts[p]` from
        position starts[p], left-padded to a bucketed length (`chunk_bucket`), the rows'
        KV stores reallocated at `chunk_capacity` columns if they have another. Returns the
        final-normed hidden state of each row's last token [P, 1, H]; stores the rows' new
        state in `state` as an eager forward of the unpadded chunk leaves it, but that the
        padding joins each KV row's left pad (the row's stored tokens move right over it,
        as KVStore.store does for padding after real tokens)."""
        rows, stores = len(prompts), state.layers
        shape = self.chunk_shape([len(p) for p in prompts], self.kv_columns([state]))
        _, (_, length_b), capacity = shape
        pads = [length_b - len(p) for p in prompts]
        ids = [[0] * pad + list(p) for pad, p in zip(pads, prompts, strict=True)]
        kv = [s for s in stores if isinstance(s, KVStore)]
        ssm = [s for s in stores if isinstance(s, SSMState)]
        if kv and kv[0].arrays is None or any(s.conv is None for s in ssm):
            raise ValueError("a compiled chunk needs rows that hold state")
        if state.num_rows != rows:
            raise ValueError(f"{rows} chunks for a state of {state.num_rows} rows")
        size = kv[0].size if kv else 0
        for store in kv:
            store.reserve(length_b, capacity)
        old_pad = kv[0].left_pad if kv else [0] * rows
        left_pad = [p + pad for p, pad in zip(old_pad, pads, strict=True)]
        flat = [a for s in kv for a in s.arrays] + [a for s in ssm for a in (s.conv, s.ssm)]
        self._stores = stores
        self.shapes.add(shape)
        hidden, *new = self._chunk_fn(
            mx.array(ids, dtype=mx.int32),
            mx.array(starts, dtype=mx.int32),
            mx.array(pads, dtype=mx.int32),
            mx.array(left_pad, dtype=mx.int32),
            mx.array([size], mx.int32),
            *flat,
        )
        for store in kv:
            n = len(store.arrays)
            store.arrays, new = list(new[:n]), new[n:]
            store.size += length_b
            store.left_pad = list(left_pad)
        for store in ssm:
            (store.conv, store.ssm), new = new[:2], new[2:]
        return hidden

    def _run(
        self,
        tokens: mx.array,
        offsets: Sequence[int] | mx.array,
        state: BatchState,
        verify: bool,
    ) -> tuple[mx.array, mx.array | None]:
        """Flatten the stores' arrays, call the traced decode (or verify) body, store the
        new arrays it returns; returns its first output (and the verify's logits) for the
        live rows. Dead rows after them run on token 0 from position 0. The KV rows'
        left pads go in as an array, a pending rollback's included (KVStore.pad_array)."""
        live, rows = tokens.shape[0], state.num_rows
        if not isinstance(offsets, mx.array):
            offsets = mx.array(list(offsets), dtype=mx.int32)
        if rows > live:  # dead rows that hold the batch at its bucket size (RowStates)
            dead = mx.zeros((rows - live, tokens.shape[1]), tokens.dtype)
            tokens = mx.concatenate([tokens, dead])
            offsets = mx.concatenate([offsets, mx.zeros((rows - live,), offsets.dtype)])
        stores = state.layers
        kv = [s for s in stores if isinstance(s, KVStore)]
        ssm = [s for s in stores if isinstance(s, SSMState)]
        if kv and kv[0].arrays is None or any(s.conv is None for s in ssm):
            raise ValueError("compiled decode needs prefilled rows (state arrays present)")
        columns = tokens.shape[1]
        for store in kv:
            store.reserve(columns)
        size = kv[0].size if kv else 0
        assert all(s.size == size and s.left_pad == kv[0].left_pad for s in kv), (
            "KV stores of one batch disagree on their columns"
        )
        flat = [a for s in kv for a in s.arrays] + [a for s in ssm for a in (s.conv, s.ssm)]
        left_pad = kv[0].pad_array() if kv else mx.zeros((state.num_rows,), mx.int32)
        self._stores = stores
        self.shapes.add((verify, tuple(tokens.shape), tuple(flat[0].shape) if kv else ()))
        fn = self._verify_fn if verify else self._fn
        first, *new = fn(
            tokens, offsets.astype(mx.int32), left_pad, mx.array([size], mx.int32), *flat
        )
        second = new.pop(0) if verify else None
        for store in kv:
            n = len(store.arrays)
            store.arrays, new = list(new[:n]), new[n:]
            store.size += columns
        for store in ssm:
            (store.conv, store.ssm), new = new[:2], new[2:]
            if verify:
                store.slots, new = (new[0], new[1]), new[2:]
        if rows > live:
            first = first[:live]
            second = second[:live] if second is not None else None
        return first, second

    def _views(
        self,
        flat: Sequence[mx.array],
        left_pad: mx.array,
        size: mx.array,
        moved: mx.array | None = None,
    ) -> tuple[list[KVView | SSMView], list[KVView], list[SSMView]]:
        """Per-layer views over the traced call's flat arrays (KV stores' first, then
        each DeltaNet layer's conv and state); `moved` as KVView says."""
        views: list[KVView | SSMView] = []
        rest = list(flat)
        kv_views, ssm_views = [], []
        for store in self._stores:
            if isinstance(store, KVStore):
                n = len(store.arrays)
                view = KVView(store, rest[:n], left_pad, size, moved)
                rest = rest[n:]
                kv_views.append(view)
            else:
                view = SSMView(None, None)
                ssm_views.append(view)
            views.append(view)
        for view in ssm_views:
            (view.conv, view.ssm), rest = rest[:2], rest[2:]
        return views, kv_views, ssm_views

    def _forward(
        self, tokens: mx.array, offsets: mx.array, left_pad: mx.array, size: mx.array, *flat
    ) -> list[mx.array]:
        """The traced decode body: run the model over the views, return logits followed
        by every layer's new arrays in the order they came in."""
        views, kv_views, ssm_views = self._views(flat, left_pad, size)
        positions = mx.broadcast_to(offsets[None, :, None], (3, offsets.shape[0], 1))
        hidden = self.model([ForwardGroup(tokens, positions, views)])[0]
        out = [self.model.logits(hidden[:, -1])]
        for view in kv_views:
            out += view.arrays
        for view in ssm_views:
            out += [view.conv, view.ssm]
        return out

    def _verify_forward(
        self, tokens: mx.array, offsets: mx.array, left_pad: mx.array, size: mx.array, *flat
    ) -> list[mx.array]:
        """The traced verify body: hidden and logits of every column, then every layer's
        new arrays (a DeltaNet layer's followed by its slots)."""
        views, kv_views, ssm_views = self._views(flat, left_pad, size)
        b, length = tokens.shape
        columns = offsets[:, None] + mx.arange(length, dtype=mx.int32)[None]
        positions = mx.broadcast_to(columns[None], (3, b, length))
        group = ForwardGroup(tokens, positions, views, state_slots=True)
        hidden = self.model([group])[0]
        out = [hidden, self.model.logits(hidden)]
        for view in kv_views:
            out += view.arrays
        for view in ssm_views:
            assert view.slots is not None, "a verify forward keeps every column's state"
            out += [view.conv, view.ssm, *view.slots]
        return out

    def _chunk_forward(
        self,
        tokens: mx.array,
        starts: mx.array,
        pads: mx.array,
        left_pad: mx.array,
        size: mx.array,
        *flat: mx.array,
    ) -> list[mx.array]:
        """The traced chunk body: [P, L] tokens, row p's first pads[p] of them padding
        (a no-op on its DeltaNet state; KV: they join its left pad, now left_pad[p]);
        returns the last position's hidden state, then every layer's new arrays."""
        views, kv_views, ssm_views = self._views(flat, left_pad, size, moved=pads)
        b, length = tokens.shape
        columns = mx.arange(length, dtype=mx.int32)[None]
        offsets = mx.maximum(starts[:, None] - pads[:, None] + columns, 0)
        positions = mx.broadcast_to(offsets[None], (3, b, length))
        group = ForwardGroup(tokens, positions, views, pads, outputs="last")
        out = [self.model([group])[0]]
        for view in kv_views:
            out += view.arrays
        for view in ssm_views:
            out += [view.conv, view.ssm]
        return out
