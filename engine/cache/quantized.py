"""Quantized KV stores: MLX affine (4/8-bit) and TurboQuant (rotated Lloyd-Max codes).

Both keep the base layout (every array [B, Hkv, T, X], right-aligned, left-padded), so
merge / filter / extract are the base's, unchanged. Each token is quantized on its own
(affine groups run along D; TurboQuant codes one vector at a time), so a row's stored
bytes never depend on how its prompt was chunked or which rows shared its batch.

Stored arrays per token and KV head (D = head_dim, s = dtype of the computed K/V):
  AffineKV      k_packed [D*bits/32] uint32, k_scales [D/g] s, k_biases [D/g] s, same for v
  TurboQuantKV  k_codes [D*kb/32] uint32, k_norm [1] float16, v_codes [D*vb/32], v_norm [1]
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.engine.cache.kv import KVStore
from deltaserve.kernels.quant_attention import (
    affine_attention,
    affine_scores,
    affine_weighted_sum,
    fold_queries,
)
from deltaserve.kernels.turboquant import turboquant_quantize
from deltaserve.kernels.turboquant_attention import (
    turboquant_attention,
    turboquant_rotate_queries,
    turboquant_scores,
    turboquant_weighted_sum,
)


class AffineKV(KVStore):
    """mx.quantize'd keys and values: (packed, scales, biases) for each.

    group_size is capped at head_dim (MLX groups run along D and must divide it).
    """

    def __init__(self, bits: int = 8, group_size: int = 64) -> None:
        super().__init__()
        self.bits = bits
        self.group_size = group_size

    def empty_like(self) -> AffineKV:
        return AffineKV(self.bits, self.group_size)

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        group = min(self.group_size, keys.shape[-1])
        k = mx.quantize(keys, group_size=group, bits=self.bits)
        v = mx.quantize(values, group_size=group, bits=self.bits)
        return [*k, *v]

    def _group(self, arrays: list[mx.array]) -> int:
        # D = packed words * 32 / bits; groups = number of scales per token.
        head_dim = arrays[0].shape[-1] * 32 // self.bits
        return head_dim // arrays[1].shape[-1]

    def attend_stored(
        self, queries: mx.array, arrays: list[mx.array], scale: float, mask: mx.array | None
    ) -> mx.array:
        group = self._group(arrays)
        return affine_attention(queries, *arrays, scale, mask, group, self.bits)

    def scores(self, queries: mx.array, arrays: list[mx.array], scale: float) -> mx.array:
        folded = fold_queries(queries * scale, arrays[0].shape[1])
        scores = affine_scores(folded, *arrays[:3], self._group(arrays), self.bits)
        return scores.astype(mx.float32)

    def weighted_sum(self, probs: mx.array, arrays: list[mx.array]) -> mx.array:
        out = affine_weighted_sum(probs, *arrays[3:], self._group(arrays), self.bits)
        return out.astype(mx.float32)


class TurboQuantKV(KVStore):
    """TurboQuant_mse keys and values with separate bit widths (defaults K8 V3)."""

    def __init__(self, key_bits: int = 8, value_bits: int = 3) -> None:
        super().__init__()
        self.key_bits = key_bits
        self.value_bits = value_bits

    def empty_like(self) -> TurboQuantKV:
        return TurboQuantKV(self.key_bits, self.value_bits)

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        k_codes, k_norm = turboquant_quantize(keys, self.key_bits)
        v_codes, v_norm = turboquant_quantize(values, self.value_bits)
        return [k_codes, k_norm, v_codes, v_norm]

    def attend_stored(
        self, queries: mx.array, arrays: list[mx.array], scale: float, mask: mx.array | None
    ) -> mx.array:
        return turboquant_attention(queries, *arrays, scale, mask, self.key_bits, self.value_bits)

    def scores(self, queries: mx.array, arrays: list[mx.array], scale: float) -> mx.array:
        q_rot = turboquant_rotate_queries(queries, arrays[0].shape[1], scale)
        return turboquant_scores(q_rot, arrays[0], arrays[1], self.key_bits)

    def weighted_sum(self, probs: mx.array, arrays: list[mx.array]) -> mx.array:
        head_dim = arrays[2].shape[-1] * 32 // self.value_bits
        return turboquant_weighted_sum(probs, arrays[2], arrays[3], self.value_bits, head_dim)
