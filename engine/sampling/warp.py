"""The distribution a row samples from: its logits under temperature, top_k, top_p, min_p.

One definition for every place that needs it: the sampler draws from it (Gumbel-max over
the kept tokens, engine/sampling/sampler.py), and speculative sampling needs it as
probabilities, for the MTP head's drafts (q) and for the verified positions (p), so that
accepted tokens follow exactly what the row would have sampled (engine/speculative.py).

Order as HF's warpers: temperature scales the logits; top_k keeps the k largest; top_p
keeps the leading tokens of those while the mass before each is < top_p of the top-k
mass; min_p keeps tokens with p >= min_p * p_max. A token stays when its scaled logit is
>= the cut (`keep_threshold`), so ties at a cut all stay (the sampler's top-k fast path,
which keeps exactly k, differs from this only on exact ties at the k-th value).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from deltaserve.engine.types import SamplingParams


@dataclass(frozen=True)
class Warp:
    """Per-row arrays of the transform (R rows). Built once per batch from its params."""

    inv_temp: mx.array  # [R, 1] float32 (1 for greedy rows, which take the argmax instead)
    top_k: mx.array  # [R] int32 in [1, V]; V where top_k is off
    top_p: mx.array  # [R] float32
    log_min_p: mx.array | None  # [R, 1] float32, -inf where off; None when no row uses it
    kmax: int  # the largest top_k
    truncates: bool  # some row uses top_k or top_p: the cut needs its row sorted

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int) -> Warp:
        """The arrays of rows with these params over a vocabulary of `vocab` tokens."""
        inv_temp = mx.array([[1.0 / p.temperature if p.temperature else 1.0] for p in params])
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        log_min_p = None
        if any(p.min_p > 0 for p in params):
            values = [[math.log(p.min_p) if p.min_p > 0 else -math.inf] for p in params]
            log_min_p = mx.array(values, dtype=mx.float32)
        truncates = any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params)
        return cls(
            inv_temp,
            mx.array(top_k, dtype=mx.int32),
            mx.array([p.top_p for p in params], dtype=mx.float32),
            log_min_p,
            max(top_k),
            truncates,
        )

    def repeat(self, times: int) -> Warp:
        """Each row `times` times in a row: the warp of [R * times, V] logits laid out as
        [R, times, V] (a row's several positions)."""
        log_min_p = self.log_min_p
        return Warp(
            mx.repeat(self.inv_temp, times, axis=0),
            mx.repeat(self.top_k, times, axis=0),
            mx.repeat(self.top_p, times, axis=0),
            None if log_min_p is None else mx.repeat(log_min_p, times, axis=0),
            self.kmax,
            self.truncates,
        )


def nucleus_size(s: mx.array, k: mx.array, top_p: mx.array) -> mx.array:
    """How many of the logits s [G, L] (sorted descending) top_k then top_p keep: [G, 1].

    top_p works on the top-k renormalised distribution (HF warper order): token i stays
    while the mass strictly before it is < top_p * mass(top k). k [G] int32 in [1, L].
    """
    p = mx.exp(s - s[:, :1])
    csum = mx.cumsum(p, axis=-1)
    mass_k = mx.take_along_axis(csum, (k - 1)[:, None], axis=-1)
    limit = mx.where(top_p[:, None] < 1.0, top_p[:, None] * mass_k, mx.inf)
    n_keep = mx.sum((csum - p) < limit, axis=-1, keepdims=True).astype(mx.int32)
    return mx.clip(mx.minimum(n_keep, k[:, None]), 1, None)


def keep_threshold(y: mx.array, warp: Warp, descending: mx.array | None) -> mx.array:
    """The cut [R, 1] of scaled logits y [R, V]: tokens with y >= it stay. `descending`:
    y sorted descending along the vocabulary, needed when top_k or top_p applies (None:
    only min_p cuts)."""
    thr = mx.full((y.shape[0], 1), -mx.inf, dtype=mx.float32)
    y_max = None
    if descending is not None:
        # Ties at the cut all stay ("y >= threshold").
        cut = nucleus_size(descending, warp.top_k, warp.top_p) - 1
        thr = mx.take_along_axis(descending, cut, axis=-1)
        y_max = descending[:, :1]
    if warp.log_min_p is not None:
        # p / p_max >= min_p  <=>  y >= y_max + log(min_p); the max always survives
        # top_p, so applying min_p after it is the same as intersecting.
        y_max = mx.max(y, axis=-1, keepdims=True) if y_max is None else y_max
        thr = mx.maximum(thr, y_max + warp.log_min_p)
    return thr


def warp_logits(logits: mx.array, warp: Warp) -> mx.array:
    """[R, V] logits -> the rows' scaled logits with dropped tokens at -inf (float32)."""
    y = logits.astype(mx.float32) * warp.inv_temp
    descending = mx.sort(y, axis=-1)[:, ::-1] if warp.truncates else None
    return mx.where(y >= keep_threshold(y, warp, descending), y, -mx.inf)


def warp_probs(logits: mx.array, warp: Warp) -> mx.array:
    """[R, V] logits -> each row's sampling distribution [R, V] float32."""
    return mx.softmax(warp_logits(logits, warp), axis=-1)
