"""Attention over MLX-affine-quantized K/V, plus the pieces every split attention shares.

Shapes: queries [B, Hq, L, D]; stored arrays [B, Hkv, S, X]; query head h reads KV head
h // (Hq / Hkv). GQA folds the repeat into the query rows: [B, Hkv, rep * L, D], so every
matmul runs on the stored arrays as they are (no broadcast copy of K/V per repeat).

mask: None (attend everything), "causal" (query i of L sees keys 0 .. S - L + i), or a
bool [B, 1, L, S] (True = attend). Masked scores become the float32 minimum, not -inf: a
query row with no visible key (a padding position) then gets a uniform average, as
mx.fast.scaled_dot_product_attention gives it, never NaN.

Attention is split into scores -> softmax -> weighted sum so that a store holding two
parts (e.g. a full-precision prefix and a quantized rest) can run ONE softmax over both:
concatenate the parts' scores along S, `masked_softmax`, split, add the weighted sums.

Affine: keys and values are (packed uint32, scales, biases) from mx.quantize along D.
Decode (fewer than DEQUANT_ROWS query rows per KV head): scores come from
mx.quantized_matmul(q, k, transpose=True) and the output from mx.quantized_matmul(p, v,
transpose=False), with no full-precision copy of the cache. Prefill chunks (many query
rows): quantized_matmul does not use BLAS on CPU and runs 3-6x slower than dequantize +
fused SDPA (measured, bench/kv_cache.py), so those dequantize the stored columns and call
mx.fast SDPA. The transient copy is one layer of the group's rows only; the engine
prefills [1, C] groups, so it is one row's cache, and already smaller than the
[rep * L, S] score matrix once rep * L > 2 * D. On CUDA, float32 queries dequantize at
every size: MLX's CUDA quantized_matmul has no float32 kernel (mlx-cuda 0.32.4 raises "No
implementation for problem shape ... activation: float32"; H100, 2026-12-05).
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.kernels.attention import attention
from deltaserve.kernels.platform import current_platform

__all__ = [
    "DEQUANT_ROWS",
    "Mask",
    "affine_attention",
    "affine_attention_reference",
    "affine_scores",
    "affine_weighted_sum",
    "apply_mask",
    "dense_attention_reference",
    "fold_queries",
    "masked_softmax",
    "unfold_output",
]

Mask = mx.array | str | None
DEQUANT_ROWS = 16  # query rows per KV head from which affine prefill dequantizes (CPU)
_MIN = float(mx.finfo(mx.float32).min)


def fold_queries(queries: mx.array, num_kv_heads: int) -> mx.array:
    """[B, Hq, L, D] -> [B, Hkv, rep * L, D] (rows ordered (rep, L))."""
    b, hq, length, d = queries.shape
    return queries.reshape(b, num_kv_heads, (hq // num_kv_heads) * length, d)


def unfold_output(out: mx.array, num_q_heads: int) -> mx.array:
    """[B, Hkv, rep * L, D] -> [B, Hq, L, D]."""
    b, hkv, rows, d = out.shape
    return out.reshape(b, num_q_heads, rows * hkv // num_q_heads, d)


def apply_mask(scores: mx.array, mask: Mask, length: int) -> mx.array:
    """scores [B, Hkv, rep * L, S] float32 with masked entries set to the float32 min."""
    if mask is None:
        return scores
    b, hkv, rows, s = scores.shape
    if isinstance(mask, str):
        assert mask == "causal", f"unknown mask {mask!r}"
        q_pos = mx.arange(s - length, s)[:, None]
        mask = (mx.arange(s)[None, :] <= q_pos)[None, None]  # [1, 1, L, S]
    # View rows as (rep, L) so the [B, 1, L, S] mask broadcasts over heads and repeats.
    scores = scores.reshape(b, hkv, rows // length, length, s)
    scores = mx.where(mask[:, :, None], scores, _MIN)
    return scores.reshape(b, hkv, rows, s)


def masked_softmax(scores: mx.array, mask: Mask, length: int) -> mx.array:
    """Softmax over the last axis in float32 after masking."""
    return mx.softmax(apply_mask(scores.astype(mx.float32), mask, length), axis=-1)


# --------------------------------------------------------------------------- affine


def _dequantizes(x: mx.array) -> bool:
    """Whether a few rows' product with quantized K/V still dequantizes: float32 on CUDA,
    which has no float32 quantized_matmul (module docstring)."""
    return x.dtype == mx.float32 and current_platform().device == "cuda"


def affine_scores(
    q: mx.array, k_q: mx.array, k_s: mx.array, k_b: mx.array, group_size: int, bits: int
) -> mx.array:
    """Folded, pre-scaled queries [B, Hkv, R, D] x quantized keys -> [B, Hkv, R, S]."""
    q = q.astype(k_s.dtype)  # quantized_matmul wants the scales' dtype
    if q.shape[2] >= DEQUANT_ROWS or _dequantizes(q):  # prefill: dequantize + BLAS matmul
        keys = mx.dequantize(k_q, k_s, k_b, group_size=group_size, bits=bits)
        return q @ keys.swapaxes(-1, -2)
    return mx.quantized_matmul(q, k_q, k_s, k_b, transpose=True, group_size=group_size, bits=bits)


def affine_weighted_sum(
    probs: mx.array, v_q: mx.array, v_s: mx.array, v_b: mx.array, group_size: int, bits: int
) -> mx.array:
    """probs [B, Hkv, R, S] x quantized values [B, Hkv, S, X] -> [B, Hkv, R, D]."""
    probs = probs.astype(v_s.dtype)
    if probs.shape[2] >= DEQUANT_ROWS or _dequantizes(probs):
        return probs @ mx.dequantize(v_q, v_s, v_b, group_size=group_size, bits=bits)
    return mx.quantized_matmul(
        probs, v_q, v_s, v_b, transpose=False, group_size=group_size, bits=bits
    )


def affine_attention(
    q: mx.array,
    k_q: mx.array,
    k_s: mx.array,
    k_b: mx.array,
    v_q: mx.array,
    v_s: mx.array,
    v_b: mx.array,
    scale: float,
    mask: Mask,
    group_size: int,
    bits: int,
) -> mx.array:
    """Attention of q [B, Hq, L, D] over affine-quantized K/V; returns [B, Hq, L, D]."""
    hq, length = q.shape[1], q.shape[2]
    if (hq // k_q.shape[1]) * length >= DEQUANT_ROWS:
        keys = mx.dequantize(k_q, k_s, k_b, group_size=group_size, bits=bits)
        values = mx.dequantize(v_q, v_s, v_b, group_size=group_size, bits=bits)
        return attention(q, keys, values, scale, mask)
    folded = fold_queries(q * scale, k_q.shape[1])
    scores = affine_scores(folded, k_q, k_s, k_b, group_size, bits)
    probs = masked_softmax(scores, mask, length)
    out = affine_weighted_sum(probs, v_q, v_s, v_b, group_size, bits)
    return unfold_output(out, hq).astype(q.dtype)


def affine_attention_reference(
    q: mx.array,
    k_q: mx.array,
    k_s: mx.array,
    k_b: mx.array,
    v_q: mx.array,
    v_s: mx.array,
    v_b: mx.array,
    scale: float,
    mask: Mask,
    group_size: int,
    bits: int,
) -> mx.array:
    """Plain reference: dequantize the whole cache, then float32 attention."""
    keys = mx.dequantize(k_q, k_s, k_b, group_size=group_size, bits=bits)
    values = mx.dequantize(v_q, v_s, v_b, group_size=group_size, bits=bits)
    return dense_attention_reference(q, keys, values, scale, mask)


def dense_attention_reference(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Mask
) -> mx.array:
    """Float32 attention written out op by op (used by the references and tests)."""
    hq, hkv, length = q.shape[1], keys.shape[1], q.shape[2]
    rep = hq // hkv
    keys = mx.repeat(keys.astype(mx.float32), rep, axis=1)
    values = mx.repeat(values.astype(mx.float32), rep, axis=1)
    scores = (q.astype(mx.float32) * scale) @ keys.swapaxes(-1, -2)  # [B, Hq, L, S]
    # Reuse the masking of the fast path on a [B, Hq, L, S] = [B, Hq, 1 * L, S] view.
    probs = masked_softmax(scores, mask, length)
    return (probs @ values).astype(q.dtype)
