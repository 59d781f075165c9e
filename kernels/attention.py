"""Scaled dot-product attention over a (left-padded) KV store, one function per backend.

On Metal/CUDA: mx.fast.scaled_dot_product_attention. On CPU its softmax runs MLX's exp at
~25 ns per score (a 64-token chunk against 4K cached tokens spends most of its attention
time there), so the CPU path is two BLAS matmuls around a softmax built on
deltaserve.kernels.fastmath.exp2. Reference: mx.fast.scaled_dot_product_attention itself.
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.kernels import fastmath
from deltaserve.kernels.platform import current_platform

_LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x log2 e)


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """queries [B, Hq, L, D], keys/values [B, Hkv, S, D] (Hq a multiple of Hkv); mask None,
    "causal" (last query aligned with last key) or bool [B|1, 1, L, S] (True = attend).
    Returns [B, Hq, L, D]."""
    if not current_platform().is_cpu or queries.shape[2] == 1:
        # Decode (L = 1) has only S scores per head: the fused op is as fast there.
        return attention_reference(queries, keys, values, scale, mask)
    return _attention_cpu(queries, keys, values, scale, mask)


def attention_reference(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _attention_cpu(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """Passes over the [.., L, S] scores are what cost here (a few ns per element each),
    so: scores in base 2 (log2 e folded into the query scale: the exponential is one
    power op), the normalisation applied to the [.., L, D] output instead of the
    weights, and with a "causal" mask only the chunk's own L columns masked (the S - L
    cached ones are visible to every query: a separate block, softmaxed jointly).
    GQA folds a KV head's `rep` query heads into the rows of one matmul: a batch axis
    broadcast over them instead (K/V [B, Hkv, 1, S, D]) took MLX's slow path, 15.6 ms
    against 0.8 ms for 57 queries over 2,062 keys."""
    b, hq, length, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    q = (queries * (scale * _LOG2E)).reshape(b, hkv, rep * length, d)
    if isinstance(mask, str):
        causal = mx.tri(length, dtype=mx.bool_)  # [L, L]: query i sees the chunk's keys <= i
        past = s - length
        blocks = [(keys[:, :, past:], values[:, :, past:], causal)]
        if past:
            blocks.insert(0, (keys[:, :, :past], values[:, :, :past], None))
    else:
        blocks = [(keys, values, mask[:, :, None] if mask is not None and mask.ndim == 4 else mask)]
    scores = [_masked(q @ kb.swapaxes(-1, -2), m, rep) for kb, _, m in blocks]
    top = scores[0].max(axis=-1, keepdims=True)
    for more in scores[1:]:
        top = mx.maximum(top, more.max(axis=-1, keepdims=True))
    out, total = None, None
    for sc, (_, vb, _) in zip(scores, blocks, strict=True):
        w = fastmath.exp2(sc - top)  # [B, Hkv, rep * L, S_block]
        part, norm = w.astype(values.dtype) @ vb, w.sum(axis=-1, keepdims=True)
        out, total = (part, norm) if out is None else (out + part, total + norm)
    out = (out / total).astype(values.dtype)  # [B, Hkv, rep * L, D]
    return out.reshape(b, hq, length, d)


def _masked(scores: mx.array, mask: mx.array | None, rep: int) -> mx.array:
    """Float32 scores [B, Hkv, rep * L, S] with masked entries (mask [L, S] or
    [B|1, 1, 1, L, S]) at a large finite value, not -inf: padding query rows see no key
    at all, and -inf there would give NaN weights (and 0 * NaN poisons the padded values)."""
    scores = scores if scores.dtype == mx.float32 else scores.astype(mx.float32)
    if mask is None:
        return scores
    b, hkv, rows, s = scores.shape
    split = scores.reshape(b, hkv, rep, rows // rep, s)  # free: the rows are rep-major
    split = mx.where(mask, split, mx.array(-1e30, dtype=mx.float32))
    return split.reshape(b, hkv, rows, s)
