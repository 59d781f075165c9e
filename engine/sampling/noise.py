"""Counter-based randomness for the sampler: a row's Gumbel noise is a hash of (row key,
vocab id), so a seeded row's draws depend on nothing else in the batch (engine/sampling/sampler.py).

A key also names a stream: 0 is the sampler's one draw per output index. A seeded row
that speculates (engine/speculative.py) draws its drafts and its verified tokens with
stream 0's keys of the output indices they stand for, which is what makes its text the
same as without speculation; other streams are free for draws of other purposes.
"""

from __future__ import annotations

import mlx.core as mx

_M64 = (1 << 64) - 1
_FMIX_C1 = mx.array(0x85EBCA6B, dtype=mx.uint32)
_FMIX_C2 = mx.array(0xC2B2AE35, dtype=mx.uint32)


def splitmix64(x: int) -> int:
    """SplitMix64 output for state x (Python ints, masked to 64 bits)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, choice: int, step: int, stream: int = 0) -> int:
    """64-bit noise key of a seeded row at `step` in `stream` (the module docstring);
    depends on nothing else in the batch. Stream 0 is the sampler's own."""
    key = splitmix64(splitmix64(splitmix64(seed) ^ choice) ^ step)
    return splitmix64(key ^ stream) if stream else key


def _fmix32(h: mx.array) -> mx.array:
    # MurmurHash3 finaliser: a bijection on uint32 with full avalanche.
    h = h ^ (h >> 16)
    h = h * _FMIX_C1
    h = h ^ (h >> 13)
    h = h * _FMIX_C2
    return h ^ (h >> 16)


def uniform_noise(k0: mx.array, k1: mx.array, ids: mx.array) -> mx.array:
    """Uniform noise in (0, 1) of counters `ids` (uint32) for row keys k0, k1 ([S, 1] uint32)."""
    h = _fmix32(_fmix32(ids ^ k0) ^ k1)
    # Top 23 bits -> u = (k + 0.5) / 2^23 in (0, 1): 24 significant bits, exact in float32,
    # never 0 or 1 (logs stay finite). With 24 bits the top value rounded up to 1.0: an
    # infinite draw that won (1.5% of rows at 248k tokens) even where the mask said -inf.
    return ((h >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(k0: mx.array, k1: mx.array, ids: mx.array) -> mx.array:
    """Standard Gumbel noise of vocab `ids` (uint32) for row keys k0, k1 ([S, 1] uint32)."""
    return -mx.log(-mx.log(uniform_noise(k0, k1, ids)))
