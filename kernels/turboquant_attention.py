"""Attention over TurboQuant K/V (kernels/turboquant.py), computed in the rotated space.

R is orthonormal, so <q, k> = <R q, R k> and R k ~ ||k|| * c[k_idx] / sqrt(d):
    scores[i, j] = scale * ||k_j|| / sqrt(d) * <R q_i, c_k[k_idx_j]>
    out_i        = R^T( sum_j p_ij * ||v_j|| / sqrt(d) * c_v[v_idx_j] )
The query is rotated once and the output inverse-rotated once (L rows, not S): no key or
value is ever rotated back. The centroid gather c[idx] is done per block of keys, so the
float32 intermediate is bounded ([B, Hkv, block, D], ~32 MiB) whatever S is.

Shapes as in kernels/quant_attention.py: q [B, Hq, L, D]; k_idx/v_idx [B, Hkv, S, D*b/32]
uint32; k_norm/v_norm [B, Hkv, S, 1] float16; mask None | "causal" | bool [B, 1, L, S].
`turboquant_attention_dequantized` (dequantize everything, then mx.fast SDPA) is the
alternative the benchmark compares against; `turboquant_attention_reference` is the plain
reference the tests use.
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.kernels.quant_attention import (
    Mask,
    dense_attention_reference,
    fold_queries,
    masked_softmax,
    unfold_output,
)
from deltaserve.kernels.turboquant import lookup_centroids, rotate, turboquant_dequantize, unrotate

__all__ = [
    "turboquant_attention",
    "turboquant_attention_dequantized",
    "turboquant_attention_reference",
    "turboquant_rotate_queries",
    "turboquant_scores",
    "turboquant_weighted_sum",
]

_BLOCK_ELEMENTS = 1 << 23  # float32 elements of one gathered centroid block (32 MiB)


def _block(shape: tuple[int, ...], d: int) -> int:
    """Keys per block for stored arrays of shape [B, Hkv, S, X] and head_dim d."""
    b, hkv, _, _ = shape
    return max(256, _BLOCK_ELEMENTS // max(1, b * hkv * d))


def turboquant_rotate_queries(q: mx.array, num_kv_heads: int, scale: float) -> mx.array:
    """q [B, Hq, L, D] -> folded, rotated queries [B, Hkv, rep*L, D] with scale / sqrt(d)."""
    d = q.shape[-1]
    return rotate(fold_queries(q.astype(mx.float32), num_kv_heads)) * (scale * d**-0.5)


def turboquant_scores(q_rot: mx.array, k_idx: mx.array, k_norm: mx.array, bits: int) -> mx.array:
    """Rotated queries [B, Hkv, R, D] x TurboQuant keys -> scores [B, Hkv, R, S] float32."""
    d, s = q_rot.shape[-1], k_idx.shape[2]
    step = _block(k_idx.shape, d)
    parts = [
        q_rot @ lookup_centroids(k_idx[:, :, lo : lo + step], bits, d).swapaxes(-1, -2)
        for lo in range(0, s, step)
    ]
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    # Per-key norm [B, Hkv, S, 1] -> [B, Hkv, 1, S], broadcast over the query rows.
    return scores * k_norm.astype(mx.float32).swapaxes(-1, -2)


def turboquant_weighted_sum(
    probs: mx.array, v_idx: mx.array, v_norm: mx.array, bits: int, d: int
) -> mx.array:
    """probs [B, Hkv, R, S] x TurboQuant values -> [B, Hkv, R, D] (back in x space)."""
    s = v_idx.shape[2]
    step = _block(v_idx.shape, d)
    # Fold each value's norm / sqrt(d) into its probability column: [B, Hkv, R, S].
    weights = probs.astype(mx.float32) * (v_norm.astype(mx.float32).swapaxes(-1, -2) * d**-0.5)
    out_rot = None
    for lo in range(0, s, step):
        part = weights[..., lo : lo + step] @ lookup_centroids(v_idx[:, :, lo : lo + step], bits, d)
        out_rot = part if out_rot is None else out_rot + part
    return unrotate(out_rot)


def turboquant_attention(
    q: mx.array,
    k_idx: mx.array,
    k_norm: mx.array,
    v_idx: mx.array,
    v_norm: mx.array,
    scale: float,
    mask: Mask,
    key_bits: int,
    value_bits: int,
) -> mx.array:
    """Attention of q [B, Hq, L, D] over TurboQuant K/V; returns [B, Hq, L, D]."""
    hq, length, d = q.shape[1], q.shape[2], q.shape[3]
    q_rot = turboquant_rotate_queries(q, k_idx.shape[1], scale)
    probs = masked_softmax(turboquant_scores(q_rot, k_idx, k_norm, key_bits), mask, length)
    out = turboquant_weighted_sum(probs, v_idx, v_norm, value_bits, d)
    return unfold_output(out, hq).astype(q.dtype)


def turboquant_attention_dequantized(
    q: mx.array,
    k_idx: mx.array,
    k_norm: mx.array,
    v_idx: mx.array,
    v_norm: mx.array,
    scale: float,
    mask: Mask,
    key_bits: int,
    value_bits: int,
) -> mx.array:
    """The alternative: dequantize all K/V (rotating each back), then fused SDPA."""
    d = q.shape[-1]
    keys = turboquant_dequantize(k_idx, k_norm, key_bits, d).astype(q.dtype)
    values = turboquant_dequantize(v_idx, v_norm, value_bits, d).astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def turboquant_attention_reference(
    q: mx.array,
    k_idx: mx.array,
    k_norm: mx.array,
    v_idx: mx.array,
    v_norm: mx.array,
    scale: float,
    mask: Mask,
    key_bits: int,
    value_bits: int,
) -> mx.array:
    """Plain reference: dequantize K/V, then op-by-op float32 attention."""
    d = q.shape[-1]
    keys = turboquant_dequantize(k_idx, k_norm, key_bits, d)
    values = turboquant_dequantize(v_idx, v_norm, value_bits, d)
    return dense_attention_reference(q, keys, values, scale, mask)
