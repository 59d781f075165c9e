"""The `start` policy: each row's first `start` tokens in full precision, the rest quantized.

PrefixKV wraps a quantized KVStore (`inner`) and adds a full-precision prefix part:

  prefix  keys/values [B, Hkv, start, D], LEFT-aligned: row b's first plen[b] <= start
          tokens sit in columns 0 .. plen[b]-1 (unused columns are zeros, always masked).
          A fixed width of `start` columns keeps the row ops trivial (take rows, concat).
  inner   the quantized store, right-aligned as usual. A row's prefix tokens enter it as
          left padding, so its real quantized columns start at token `start`.

Why two parts rather than converting in place: the row's first tokens are the ones that
matter most (attention sinks, the system prompt) and they are known early, while the
quantized rest keeps the base layout and row ops unchanged. start = 0 builds no wrapper.

Attention runs ONE softmax over both parts: the float32 scores of the prefix (dense
matmul) and of the inner store (its split `scores`) are masked, concatenated along keys,
softmaxed, split, and the two weighted sums added. Row ops apply to both parts.
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.engine.cache.kv import FullPrecisionKV, KVStore, fresh_copy, last_rows
from deltaserve.kernels.quant_attention import apply_mask, unfold_output

_DENSE = FullPrecisionKV()  # stateless: its scores / weighted_sum serve the prefix part


class PrefixKV:
    """A KV store (same interface as KVStore) with a full-precision per-row prefix."""

    def __init__(self, start: int, inner: KVStore) -> None:
        assert start > 0, "start = 0 needs no prefix part"
        self.start = start
        self.inner = inner
        self.prefix: list[mx.array] | None = None  # [keys, values], each [B, Hkv, start, D]
        self.plen: list[int] = []  # per row, prefix tokens stored (<= start)

    # -- interface shared with KVStore ------------------------------------------------------
    def state_arrays(self) -> list[mx.array]:
        """Every stored array (the runner evaluates these after each step)."""
        return [*self.inner.state_arrays(), *(self.prefix or [])]

    @property
    def num_rows(self) -> int:
        return len(self.plen)

    def lengths(self) -> list[int]:
        """Real tokens stored per row (prefix + quantized)."""
        if not self.inner.left_pad:
            return list(self.plen)
        return [p + n for p, n in zip(self.plen, self.inner.lengths(), strict=True)]

    def empty_like(self) -> PrefixKV:
        return PrefixKV(self.start, self.inner.empty_like())

    def bytes_per_token(self) -> int:
        """Bytes of one quantized token (a row's prefix is a fixed cost, see `nbytes`)."""
        return self.inner.bytes_per_token()

    def nbytes(self) -> int:
        prefix = sum(a.nbytes for a in self.prefix) if self.prefix is not None else 0
        return self.inner.nbytes() + prefix

    # -- attention --------------------------------------------------------------------------
    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        left_pad: tuple[int, ...] | None,
    ) -> mx.array:
        """AttentionState.attend over the prefix and the quantized rest, one softmax."""
        batch, length = keys.shape[0], keys.shape[2]
        if not self.plen:
            self.plen = [0] * batch
        pads = left_pad or (0,) * batch
        before = self.lengths()
        # The first start - plen real tokens of each row go to the prefix, the rest inward.
        taken = [
            max(0, min(self.start - p, length - pad))
            for p, pad in zip(self.plen, pads, strict=True)
        ]
        self._write_prefix(keys, values, pads, taken)
        inner_pad = tuple(pad + t for pad, t in zip(pads, taken, strict=True))
        arrays, mask = self.inner.store(keys, values, inner_pad)
        rows = queries.shape[2]  # the last `rows` new tokens query (AttentionState.attend)
        prefix_mask = last_rows(self._prefix_mask(before, pads, length), rows)
        return self._attend_both(queries, scale, arrays, last_rows(mask, rows), prefix_mask)

    def _write_prefix(
        self, keys: mx.array, values: mx.array, pads: tuple[int, ...], taken: list[int]
    ) -> None:
        if not any(taken):
            return
        if self.prefix is None:
            b, hkv, _, d = keys.shape
            self.prefix = [mx.zeros((b, hkv, self.start, d), dtype=keys.dtype) for _ in "kv"]
        for b, (pad, t) in enumerate(zip(pads, taken, strict=True)):
            if t:
                lo = self.plen[b]
                for stored, new in zip(self.prefix, (keys, values), strict=True):
                    stored[b : b + 1, :, lo : lo + t] = new[b : b + 1, :, pad : pad + t]
                self.plen[b] += t

    def _prefix_mask(
        self, before: list[int], pads: tuple[int, ...], length: int
    ) -> mx.array | None:
        """[B, 1, L, start] bool: a query sees prefix tokens stored, at or before it."""
        if all(n >= self.start for n in before):
            return None  # every row's prefix is complete and older than every query
        cols = mx.arange(self.start)[None, None, None, :]
        stored = mx.array(self.plen)[:, None, None, None]
        # Position in its row of query i: tokens before this step + (i - padding).
        first = mx.array([n - p for n, p in zip(before, pads, strict=True)])
        q_pos = first[:, None, None, None] + mx.arange(length)[None, None, :, None]
        return (cols < stored) & (cols <= q_pos)

    def _attend_both(
        self,
        queries: mx.array,
        scale: float,
        arrays: list[mx.array],
        mask: mx.array | str | None,
        prefix_mask: mx.array | None,
    ) -> mx.array:
        hq, length = queries.shape[1], queries.shape[2]
        scores = apply_mask(self.inner.scores(queries, arrays, scale), mask, length)
        if self.prefix is None:  # only when no row has stored a real token yet
            probs = mx.softmax(scores, axis=-1)
            return unfold_output(self.inner.weighted_sum(probs, arrays), hq).astype(queries.dtype)
        head = apply_mask(_DENSE.scores(queries, self.prefix, scale), prefix_mask, length)
        # One softmax over [prefix | quantized] keys: [B, Hkv, rep * L, start + S].
        probs = mx.softmax(mx.concatenate([head, scores], axis=-1), axis=-1)
        out = _DENSE.weighted_sum(probs[..., : self.start], self.prefix)
        out = out + self.inner.weighted_sum(probs[..., self.start :], arrays)
        return unfold_output(out, hq).astype(queries.dtype)

    # -- row ops ----------------------------------------------------------------------------
    def filter(self, keep: list[int]) -> None:
        """Keep rows `keep` (in that order) in both parts."""
        self.inner.filter(keep)
        if not keep:
            self.prefix, self.plen = None, []
            return
        if self.prefix is not None:
            idx = mx.array(keep)
            self.prefix = [fresh_copy(a[idx]) for a in self.prefix]
        self.plen = [self.plen[i] for i in keep]

    def rollback(self, drop: list[int]) -> None:
        """KVStore.rollback over both parts: a row's newest tokens leave the quantized
        part first, and what is left to drop leaves its prefix (plen shrinks; the
        columns beyond plen are masked, so their stale values never count)."""
        inner = self.inner.lengths() if self.inner.left_pad else [0] * self.num_rows
        from_inner = [min(d, n) for d, n in zip(drop, inner, strict=True)]
        if self.inner.left_pad:
            self.inner.rollback(from_inner)
        for b, (d, n) in enumerate(zip(drop, from_inner, strict=True)):
            assert d - n <= self.plen[b], "dropping more tokens than the row holds"
            self.plen[b] -= d - n

    def extract(self, row: int) -> PrefixKV:
        """An independent B=1 copy of `row`."""
        out = PrefixKV(self.start, self.inner.extract(row))
        if self.prefix is not None:
            out.prefix = [fresh_copy(a[row : row + 1]) for a in self.prefix]
        out.plen = [self.plen[row]]
        return out

    def merge(self, other: PrefixKV) -> None:
        """Append `other`'s rows after ours (the prefix width is always `start`)."""
        if other.num_rows == 0:
            return
        self.inner.merge(other.inner)
        template = self.prefix or other.prefix
        if template is not None:
            pairs = zip(
                self._prefix_or_zeros(template), other._prefix_or_zeros(template), strict=True
            )
            self.prefix = [mx.concatenate([a, b], axis=0) for a, b in pairs]
        self.plen = self.plen + other.plen

    def _prefix_or_zeros(self, template: list[mx.array]) -> list[mx.array]:
        if self.prefix is not None:
            return self.prefix
        return [mx.zeros((self.num_rows, *t.shape[1:]), dtype=t.dtype) for t in template]
