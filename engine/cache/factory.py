"""KV store kinds by configuration: constructor and per-element cost."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from deltaserve.engine.cache.kv import FullPrecisionKV, KVStore
from deltaserve.engine.cache.quantized import AffineKV, TurboQuantKV
from deltaserve.engine.cache.start_precision import PrefixKV
from deltaserve.engine.config import KVCacheConfig
from deltaserve.kernels.turboquant import NORM_DTYPE

AnyKV = KVStore | PrefixKV


def kv_store_factory(config: KVCacheConfig) -> Callable[[], AnyKV]:
    """A constructor of empty stores of the configured kind.

    start > 0 (quantized kinds only) wraps the store in PrefixKV: each row's first
    `start` tokens stay in full precision.
    """
    if config.kind == "fp":
        return FullPrecisionKV
    if config.kind == "affine":
        inner: Callable[[], KVStore] = partial(AffineKV, config.bits, config.group_size)
    elif config.kind == "turboquant":
        inner = partial(TurboQuantKV, config.key_bits, config.value_bits)
    else:
        raise ValueError(f"unknown KV cache kind {config.kind!r}")
    if config.start == 0:
        return inner
    return lambda: PrefixKV(config.start, inner())


def kv_bytes_per_element_pair(config: KVCacheConfig, dtype_size: int, head_dim: int) -> float:
    """Bytes one key element plus one value element take in the (quantized) store.

    dtype_size: bytes of the computed K/V (4 for float32 on CPU, 2 for bf16/fp16).
      fp          2 * dtype_size
      affine      2 * (bits / 8 + 2 * dtype_size / g)   scale + bias per group of g,
                  g = min(group_size, head_dim), in the K/V dtype
      turboquant  (key_bits + value_bits) / 8 + 2 * 2 / head_dim   (float16 norms)
    A row's full-precision prefix (start > 0) is a fixed cost: `kv_prefix_tokens`.
    """
    if config.kind == "fp":
        return 2.0 * dtype_size
    if config.kind == "affine":
        group = min(config.group_size, head_dim)
        return 2.0 * (config.bits / 8 + 2 * dtype_size / group)
    if config.kind == "turboquant":
        norms = 2 * NORM_DTYPE.size / head_dim
        return (config.key_bits + config.value_bits) / 8 + norms
    raise ValueError(f"unknown KV cache kind {config.kind!r}")


def kv_prefix_tokens(config: KVCacheConfig) -> int:
    """Tokens per row held in full precision on top of the quantized ones.

    PrefixKV stores a row's first `start` tokens at full precision AND keeps their
    columns as (quantized) padding in its inner store, so the reservation counts them
    once more at full precision.
    """
    return config.start if config.kind != "fp" else 0
