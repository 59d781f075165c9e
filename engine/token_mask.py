"""Allowed-token masks as packed bitmasks, and applying one to a batch of logits.

The layout is llguidance's (and xgrammar's): [N, ceil(V / 32)] int32 words per batch,
token t allowed when bit t % 32 of word t // 32 is set. engine/constraints.py fills it
per constrained row; the sampler applies it to all rows' logits in one fused operation.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_BIT = mx.arange(32, dtype=mx.uint32)
_F32_MAX = float(np.finfo(np.float32).max)


def _allowed_only(z: mx.array, words: mx.array) -> mx.array:
    # z [N, W, 32], words [N, W, 1] uint32. (bit - 1) * max * 2 is -inf for a cleared bit
    # (the product overflows) and 0 for a set one: an add, where mx.where would cost ~3x
    # on CPU (mlx-cpu, B=32 x 248k: 13.6 ms fused here vs 43 ms for a where alone).
    return z + (((words >> _BIT) & 1).astype(mx.float32) - 1.0) * _F32_MAX * 2.0


# One fused elementwise kernel; shapeless so a new batch size reuses the trace.
_allowed_only_fused = mx.compile(_allowed_only, shapeless=True)


def apply_token_mask(logits: mx.array, bits: np.ndarray) -> mx.array:
    """Float32 logits [N, V] with every token outside the packed bitmask `bits`
    ([N, ceil(V / 32)] int32) set to -inf."""
    n, vocab = logits.shape
    words = bits.shape[1]
    assert bits.shape[0] == n and words * 32 >= vocab, "token mask does not fit the logits"
    z = logits.astype(mx.float32)
    if words * 32 > vocab:  # pad to whole words; the padding is sliced off again
        z = mx.concatenate([z, mx.full((n, words * 32 - vocab), -mx.inf)], axis=1)
    packed = mx.array(bits).view(mx.uint32)[..., None]
    masked = _allowed_only_fused(z.reshape(n, words, 32), packed)
    return masked.reshape(n, words * 32)[:, :vocab]


def allowed_ids(bits: np.ndarray, vocab: int) -> np.ndarray:
    """The allowed token ids of one packed mask row (for tests and checks)."""
    flags = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), bitorder="little")
    return np.flatnonzero(flags[:vocab])
