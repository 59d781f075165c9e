"""KV store kinds by configuration: constructor and per-element cost."""

from __future__ import annotations

from collections.abc import Callable

from engine.cache.kv import FullPrecisionKV, KVStore
from engine.config import KVCacheConfig


def kv_store_factory(config: KVCacheConfig) -> Callable[[], KVStore]:
    """A constructor of empty stores of the configured kind."""
    if config.kind == "fp":
        return FullPrecisionKV
    raise ValueError(f"KV cache kind {config.kind!r} is not available yet")


def kv_bytes_per_element_pair(config: KVCacheConfig, dtype_size: int) -> float:
    """Bytes one key element plus one value element take in the store."""
    if config.kind == "fp":
        return 2.0 * dtype_size
    raise ValueError(f"KV cache kind {config.kind!r} is not available yet")
