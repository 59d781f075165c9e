"""Left-padded, batched KV stores for the full-attention layers.

Layout: every stored array is [B, Hkv, T, X] and all rows are right-aligned on the time
axis: row b's real tokens occupy columns left_pad[b] .. size-1. New tokens are written at
the shared right edge, so a step appends one slice for the whole batch.

Row ops (all return or keep an independent store, never a view of another batch):
  merge   join rows: left-pad the shorter store so right edges align; drop padding
          every row of a side shares
  filter  keep some rows; drop leading columns that are padding for every survivor
  extract copy one row out as a B=1 store with no padding
  rollback forget each row's own number of newest tokens (rejected speculative drafts);
          `rollback_pending` does it with counts still computing (a chained verify)

A step may pad a row that already holds tokens (the MTP head's chunks of uneven length):
that row's tokens then move right over the padding, which joins its left pad.

Subclasses say how keys/values are encoded into stored arrays (full precision, affine
4/8-bit, TurboQuant) and how attention reads them; the row ops are shared here.
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.kernels.attention import attention
from deltaserve.kernels.quant_attention import fold_queries

# Columns allocated at a time (at least). Every op that rebuilds the arrays (append
# growth, merge, filter) leaves free columns up to the next capacity step, so decode
# appends write in place and copy the whole batch only when a row crosses a step. Stable
# capacities also keep the compiled decode step (engine/decode.py) on few shapes.
_GROW = 256
# Left padding every row of a store must have before settle drops it (rollback_pending)
COMPACT_PAD = _GROW


def round_capacity(columns: int) -> int:
    """The capacity for `columns` in use, with at least one free column: a multiple of
    _GROW, and past 2,048 columns a multiple of an eighth of the power of two at or
    below them (512 from 4,096, 1,024 from 8,192, ...). Each capacity is a shape of the
    compiled decode step, traced on first use, a stall of every stream (~0.4 s on an
    H200, seconds on a fresh machine): a row growing to 32k tokens meets 40 of them
    rather than 128, and the free columns stay within an eighth of those in use."""
    step = max(_GROW, (1 << max(columns.bit_length() - 1, 0)) // 8)
    return (columns // step + 1) * step


def fresh_copy(x: mx.array) -> mx.array:
    """A copy in its own buffer. Arithmetic forces one: a slice or contiguous() may alias
    and pin the whole batch it came from."""
    return x + mx.zeros((), dtype=x.dtype)


def take_rows(x: mx.array, keep: list[int]) -> mx.array:
    """x[keep] along axis 0, built from slices of `keep`'s runs of consecutive rows: a
    view of x when `keep` is one run (the caller copies it or knows the view is brief).
    MLX's CPU gather of a column-sliced [33, 2, 256, 64] KV array took 1.9 ms against
    0.6 ms for a slice; a 2,000-token row leaving 32 short ones cost the next decode step
    17 ms of row copies through gathers, 4-5 ms now (CPU, small shape)."""
    if not keep:
        return x[:0]
    runs, start = [], 0
    for i in range(1, len(keep) + 1):
        if i == len(keep) or keep[i] != keep[i - 1] + 1:
            runs.append(x[keep[start] : keep[i - 1] + 1])
            start = i
    return runs[0] if len(runs) == 1 else mx.concatenate(runs, axis=0)


class KVStore:
    """Base class: storage of encoded K/V columns plus left-padding bookkeeping."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] | None = None  # each [B, Hkv, capacity, X]
        self.left_pad: list[int] = []  # per row, columns of padding before its tokens
        self.size = 0  # used columns (shared right edge)
        # [B] int32, lazy: padding a rollback_pending added to each row that left_pad does
        # not hold yet (settle adds it, read back); None: left_pad is every row's pad
        self.pending: mx.array | None = None

    # -- encoding, implemented by subclasses ------------------------------------------
    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """[B, Hkv, L, D] keys/values -> stored arrays, each [B, Hkv, L, X]."""
        raise NotImplementedError

    def attend_stored(
        self, queries: mx.array, arrays: list[mx.array], scale: float, mask: mx.array | None
    ) -> mx.array:
        """Attention of queries [B, Hq, L, D] over stored columns arrays[..., :size, :]."""
        raise NotImplementedError

    def bytes_per_token(self) -> int:
        """Bytes one token of one row occupies in this layer (K and V together)."""
        if self.arrays is None:
            return 0
        return sum(a.shape[1] * a.shape[3] * a.dtype.size for a in self.arrays)

    def state_arrays(self) -> list[mx.array]:
        """Every stored array (the runner evaluates these after each step)."""
        return list(self.arrays or [])

    def empty_like(self) -> KVStore:
        """A new, empty store of the same kind and settings."""
        return type(self)()

    # -- the model-facing call ----------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.left_pad)

    def lengths(self) -> list[int]:
        """Real tokens stored per row."""
        return [self.size - p for p in self.left_pad]

    def pad_array(self) -> mx.array:
        """[B] int32: each row's left pad, a pending rollback's included (the compiled
        forwards take it as an array)."""
        pads = mx.array(self.left_pad, dtype=mx.int32)
        return pads if self.pending is None else pads + self.pending

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        left_pad: tuple[int, ...] | None,
    ) -> mx.array:
        """AttentionState.attend: append [B, Hkv, L, D] and attend causally."""
        arrays, mask = self.store(keys, values, left_pad)
        return self.attend_stored(queries, arrays, scale, last_rows(mask, queries.shape[2]))

    def store(
        self, keys: mx.array, values: mx.array, left_pad: tuple[int, ...] | None
    ) -> tuple[list[mx.array], mx.array | str | None]:
        """Append this step's [B, Hkv, L, D] K/V (row b has left_pad[b] padding tokens).

        Returns the stored arrays in use ([B, Hkv, size, X] each) and the mask of the
        step's L queries over them (None, "causal", or bool [B, 1, L, size]).
        """
        batch, length = keys.shape[0], keys.shape[2]
        if not self.left_pad:
            self.left_pad = [0] * batch
        assert len(self.left_pad) == batch, "store rows and group rows differ"
        moved = [0] * batch
        if left_pad is not None and any(left_pad):
            for b, pad in enumerate(left_pad):
                if self.left_pad[b] == self.size:  # no tokens yet: plain left padding
                    self.left_pad[b] += pad
                else:  # padding after real tokens (the MTP head's uneven chunks)
                    moved[b] = pad
        size = self.size
        self._append(self.encode(keys, values))
        if any(moved):
            # The row's stored tokens move right over the step's padding columns, which
            # thereby become left padding: one gather, only in steps that need it.
            self._move_right(moved, [size + m for m in moved])
            self.left_pad = [p + m for p, m in zip(self.left_pad, moved, strict=True)]
        arrays = [a[:, :, : self.size] for a in self.arrays]
        return arrays, self._mask(length)

    # -- split attention: one softmax over several stores (see engine/cache/start_precision.py) ----
    def scores(self, queries: mx.array, arrays: list[mx.array], scale: float) -> mx.array:
        """Unmasked float32 scores [B, Hkv, rep * L, S] of queries [B, Hq, L, D]."""
        raise NotImplementedError

    def weighted_sum(self, probs: mx.array, arrays: list[mx.array]) -> mx.array:
        """probs [B, Hkv, rep * L, S] over the stored values -> [B, Hkv, rep * L, D]."""
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        """Columns allocated (used + free)."""
        return 0 if self.arrays is None else int(self.arrays[0].shape[2])

    def reserve(self, columns: int, capacity: int | None = None) -> None:
        """Make room for `columns` more columns (copies the store only when it grows), or
        with `capacity` (at least that room) reallocate at exactly that many columns
        unless the store has them already. Needs existing arrays: their shapes say what
        the new columns look like."""
        assert self.arrays is not None, "reserve() on a store that holds nothing yet"
        if capacity is not None:
            assert capacity >= self.size + columns, "a capacity without the room asked for"
            if capacity != self.capacity:
                self.arrays = self._grown(self.arrays, self.size + columns, capacity)
        elif self.size + columns > self.capacity:
            self.arrays = self._grown(self.arrays, self.size + columns)

    def _grown(
        self, template: list[mx.array], needed: int, capacity: int | None = None
    ) -> list[mx.array]:
        capacity = capacity or round_capacity(needed - 1)
        grown = []
        for i, t in enumerate(template):
            a = mx.zeros((t.shape[0], t.shape[1], capacity, t.shape[3]), dtype=t.dtype)
            if self.arrays is not None and self.size:
                a[:, :, : self.size] = self.arrays[i][:, :, : self.size]
            grown.append(a)
        return grown

    def _append(self, new: list[mx.array]) -> None:
        needed = self.size + new[0].shape[2]
        if needed > self.capacity:
            self.arrays = self._grown(new, needed)
        for a, n in zip(self.arrays, new, strict=True):
            a[:, :, self.size : needed] = n
        self.size = needed

    def _mask(self, length: int) -> mx.array | str | None:
        """[B, 1, L, size] bool: causal within the step, never padding; None if trivial."""
        if not any(self.left_pad):
            return None if length == 1 else "causal"
        cols = mx.arange(self.size)[None, None, None, :]
        pad = mx.array(self.left_pad)[:, None, None, None]
        rows = mx.arange(self.size - length, self.size)[None, None, :, None]
        return (cols >= pad) & (cols <= rows)

    # -- row ops ------------------------------------------------------------------------
    def filter(self, keep: list[int]) -> None:
        """Keep rows `keep` (in that order); trim padding every survivor shares."""
        assert self.pending is None, "rows change only once a rollback is settled"
        if not keep:
            self.arrays, self.left_pad, self.size = None, [], 0
            return
        pads = [self.left_pad[i] for i in keep]
        trim = min(pads)
        if self.arrays is not None:
            # Columns first, then rows: gathering rows of the whole capacity copied every
            # survivor's full width (a 2,000-token row leaving 32 short ones: 150 MB)
            self.arrays = [
                with_headroom([take_rows(a[:, :, trim : self.size], keep)]) for a in self.arrays
            ]
        self.left_pad = [p - trim for p in pads]
        self.size -= trim

    def load(self, parts: list[list[mx.array]]) -> None:
        """Become a B=1 store whose array i is parts[i] joined in time (encoded arrays
        [1, Hkv, T_j, X], unpadded): a prefix-cache hit (engine/prefix_cache/store.py).
        The blocks and the free columns go into one buffer in one copy."""
        self.arrays = [with_headroom(ps) for ps in parts]
        self.left_pad = [0]
        self.size = sum(int(p.shape[2]) for p in parts[0])

    def extract(self, row: int) -> KVStore:
        """An independent B=1 copy of `row`, without its padding."""
        out = self.empty_like()
        pad = self.left_pad[row]
        if self.arrays is not None:
            out.arrays = [fresh_copy(a[row : row + 1, :, pad : self.size]) for a in self.arrays]
        out.left_pad = [0]
        out.size = self.size - pad
        return out

    def merge(self, other: KVStore) -> None:
        """Append `other`'s rows after ours, right edges aligned: each side drops the
        leading columns that are padding for all its rows (as filter does), and the
        shorter side is left-padded. The result is one new buffer at round_capacity, also
        for rows joining an empty store: a row that ran compiled later chunks arrives at a
        capacity bucket of up to twice its tokens (engine/shapes.py), which its memory
        reservation holds only while it prefills."""
        if other.num_rows == 0:
            return
        assert self.pending is None and other.pending is None, "a rollback is pending"
        if self.num_rows == 0:
            self.arrays, self.left_pad, self.size = other.arrays, list(other.left_pad), other.size
            trim = min(self.left_pad)
            if self.arrays is not None and (trim or self.capacity > round_capacity(self.size)):
                self.arrays = [with_headroom([a[:, :, trim : self.size]]) for a in self.arrays]
                self.left_pad = [p - trim for p in self.left_pad]
                self.size -= trim
            return
        parts = [(part, min(part.left_pad)) for part in (self, other)]
        size = max(part.size - trim for part, trim in parts)
        template = self.arrays if self.arrays is not None else other.arrays
        arrays = None
        if template is not None:
            # One new buffer per array, each side's used columns written into place at
            # the right edge (pads and a concatenate copied the batch three times)
            rows, capacity = self.num_rows + other.num_rows, round_capacity(size)
            arrays = []
            for i, t in enumerate(template):
                out = mx.zeros((rows, t.shape[1], capacity, t.shape[3]), t.dtype)
                start = 0
                for part, trim in parts:
                    stop, used = start + part.num_rows, part.size - trim
                    if part.arrays is not None and used:
                        columns = part.arrays[i][:, :, trim : part.size]
                        out[start:stop, :, size - used : size] = columns
                    start = stop
                arrays.append(out)
        self.left_pad = [p + size - self.size for p in self.left_pad] + [
            p + size - other.size for p in other.left_pad
        ]
        self.arrays, self.size = arrays, size

    def rollback(self, drop: list[int]) -> None:
        """Forget the newest drop[b] tokens of each row b, as if it had never seen them
        (the drafts a speculative verify rejected; rows reject different counts).

        The part every row drops moves the shared right edge left (no copy). A row that
        drops `extra` more keeps its columns but shifted right by `extra`, its left pad
        growing by as much: one batched gather per stored array over the columns that
        hold any row's tokens. Why shift rather than leave holes: every attention path
        (dense, affine, TurboQuant, their kernels) already masks a left pad and nothing
        else; a per-row hole would need a second mask everywhere. Rows that drop the
        common count (typically most) gather onto themselves. Encoded columns are moved
        as stored, so quantized kinds need nothing of their own.
        """
        assert len(drop) == self.num_rows, "one drop count per row"
        lengths = self.lengths()
        assert all(0 <= d <= n for d, n in zip(drop, lengths, strict=True)), (drop, lengths)
        common = min(drop, default=0)
        self.size -= common
        extra = [d - common for d in drop]
        if any(extra):
            self._move_right(extra, [self.size] * len(extra))
        self.left_pad = [p + e for p, e in zip(self.left_pad, extra, strict=True)]

    def rollback_pending(self, drop: mx.array) -> None:
        """rollback with counts that are still computing (drop: [B] int32, lazy): a verify
        chained onto the one whose drafts they rejected is built before they are read
        back (engine/speculative.py). Nothing is known on the host, so the shared right
        edge stays and every row shifts right by its whole drop (rows that drop the same
        count gather too); the new padding is `pending` until `settle` gets the counts.
        A batch that keeps verifying this way gathers left padding (the drafts it
        rejected), dropped by settle once every row has enough of it."""
        assert self.pending is None, "a rollback is pending already"
        self._move_right(drop, None)
        self.pending = drop

    def settle(self, drop: list[int]) -> None:
        """The pending rollback's counts, read back: left_pad holds them. Once every row
        has COMPACT_PAD columns of padding, they are dropped (one copy, as filter does),
        so a batch that keeps verifying does not grow by its rejected drafts."""
        assert self.pending is not None and len(drop) == self.num_rows, "nothing pending"
        self.left_pad = [p + d for p, d in zip(self.left_pad, drop, strict=True)]
        self.pending = None
        if self.left_pad and min(self.left_pad) >= COMPACT_PAD:
            self.filter(list(range(self.num_rows)))

    def _move_right(self, shift: list[int] | mx.array, stop: list[int] | None) -> None:
        """Row b's columns below stop[b] (None: every column in use) take the values
        shift[b] columns to their left (what moves in from beyond the row's pad is
        padding: the caller grows left_pad by shift[b]); columns from stop[b] on stay.
        One gather per stored array, over the columns that hold any row's tokens."""
        if self.arrays is None:
            return
        lo = min(self.left_pad)  # columns before lo are padding for every row
        by = mx.array(shift, dtype=mx.int32) if isinstance(shift, list) else shift
        by = by.astype(mx.int32)[:, None, None, None]
        cols = mx.arange(lo, self.size, dtype=mx.int32)[None, None, :, None]
        src = mx.maximum(cols - by, lo)
        if stop is not None:
            end = mx.array(stop, dtype=mx.int32)[:, None, None, None]
            src = mx.where(cols < end, src, cols)
        src = src - lo  # [B, 1, n, 1]
        for a in self.arrays:
            index = mx.broadcast_to(src, (a.shape[0], a.shape[1], src.shape[2], a.shape[3]))
            a[:, :, lo : self.size] = mx.take_along_axis(a[:, :, lo : self.size], index, axis=2)

    def pad_rows(self, count: int) -> None:
        """Append `count` dead rows: no tokens (every column is their padding) and zero
        storage. They keep a batch at a fixed size (see RowStates); filter drops them."""
        self.left_pad += [self.size] * count
        if self.arrays is not None and count:
            self.arrays = [
                mx.concatenate([a, mx.zeros((count, *a.shape[1:]), a.dtype)], axis=0)
                for a in self.arrays
            ]

    def nbytes(self) -> int:
        """Bytes of stored columns in use (all rows, padding included)."""
        if self.arrays is None:
            return 0
        return self.num_rows * self.size * self.bytes_per_token()


def last_rows(mask: mx.array | str | None, queries: int) -> mx.array | str | None:
    """A step's mask ([B, 1, L, S] bool, "causal" or None) for its last `queries` query
    rows (AttentionState.attend: queries may be fewer than the new tokens). "causal"
    aligns the last query with the last key; for one query it is None (it sees every
    key), as for a decode token."""
    if isinstance(mask, mx.array):
        return mask[..., -queries:, :] if mask.shape[-2] != queries else mask
    return None if mask == "causal" and queries == 1 else mask


def with_headroom(parts: list[mx.array]) -> mx.array:
    """`parts` [B, Hkv, T_j, X] joined in time, with free columns up to round_capacity,
    in one fresh buffer (one copy)."""
    size = sum(int(p.shape[2]) for p in parts)
    first = parts[0]
    free = mx.zeros((*first.shape[:2], round_capacity(size) - size, first.shape[3]), first.dtype)
    return mx.concatenate([*parts, free], axis=2)


class FullPrecisionKV(KVStore):
    """Keys and values stored as computed (float32 on CPU, checkpoint dtype on GPU)."""

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        return [keys, values]

    def attend_stored(
        self, queries: mx.array, arrays: list[mx.array], scale: float, mask: mx.array | None
    ) -> mx.array:
        keys, values = arrays
        return attention(queries, keys, values, scale, mask)

    def scores(self, queries: mx.array, arrays: list[mx.array], scale: float) -> mx.array:
        keys = arrays[0]
        folded = fold_queries(queries.astype(mx.float32) * scale, keys.shape[1])
        return folded @ keys.astype(mx.float32).swapaxes(-1, -2)

    def weighted_sum(self, probs: mx.array, arrays: list[mx.array]) -> mx.array:
        return probs @ arrays[1].astype(mx.float32)
