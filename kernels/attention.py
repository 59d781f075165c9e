"""Scaled dot-product attention over a (left-padded) KV store, one function per backend.

On Metal/CUDA: mx.fast.scaled_dot_product_attention. On CPU its softmax runs MLX's exp at
~25 ns per score (a 64-token chunk against 4K cached tokens spends most of its attention
time there), so the CPU path is two BLAS matmuls around a softmax built on
kernels.fastmath.exp. Reference: mx.fast.scaled_dot_product_attention itself.
"""

from __future__ import annotations

import mlx.core as mx

from kernels import fastmath


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """queries [B, Hq, L, D], keys/values [B, Hkv, S, D] (Hq a multiple of Hkv); mask None,
    "causal" (last query aligned with last key) or bool [B|1, 1, L, S] (True = attend).
    Returns [B, Hq, L, D]."""
    if mx.default_device() != mx.cpu or queries.shape[2] == 1:
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
    b, hq, length, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    # GQA without tiling K/V: [B, Hkv, rep, L, D] @ [B, Hkv, 1, D, S] -> [B, Hkv, rep, L, S]
    q = (queries * scale).reshape(b, hkv, rep, length, d)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)
    if isinstance(mask, str):
        rows = mx.arange(s - length, s)[:, None]
        mask = mx.arange(s)[None, :] <= rows  # [L, S]
    if mask is not None:
        if mask.ndim == 4:
            mask = mask[:, :, None]  # [B, 1, 1, L, S]
        # A large finite value, not -inf: padding query rows see no key at all, and -inf
        # there would give NaN weights (and 0 * NaN poisons the padded values).
        scores = mx.where(mask, scores, mx.array(-1e30, dtype=scores.dtype))
    scores = scores.astype(mx.float32)
    weights = fastmath.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = (weights / weights.sum(axis=-1, keepdims=True)).astype(values.dtype)
    out = weights @ values[:, :, None]  # [B, Hkv, rep, L, D]
    return out.reshape(b, hq, length, d)
