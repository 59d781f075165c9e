"""kernels/attention.py (CPU matmul + fast-exp softmax) against MLX's fused SDPA."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.kernels.attention import attention, attention_reference


@pytest.mark.parametrize("mask_kind", [None, "causal", "padded"])
@pytest.mark.parametrize(("hq", "hkv", "length", "s"), [(4, 2, 7, 7), (8, 2, 5, 40), (2, 2, 1, 9)])
def test_attention_matches_fused_reference(mask_kind, hq, hkv, length, s) -> None:
    """Max abs error <= 1e-5 (float32; outputs are O(1) convex combinations of values)."""
    mx.random.seed(hq + length + s)
    b, d = 3, 16
    q = mx.random.normal((b, hq, length, d))
    k = mx.random.normal((b, hkv, s, d)) * 3
    v = mx.random.normal((b, hkv, s, d))
    mask = mask_kind
    if mask_kind == "padded":
        pad = mx.array([0, 2, 4])[:, None, None, None]
        cols = mx.arange(s)[None, None, None, :]
        rows = mx.arange(s - length, s)[None, None, :, None]
        mask = (cols >= pad) & (cols <= rows)
    if mask_kind == "causal" and length == 1:
        mask = None
    ours = np.array(attention(q, k, v, 0.25, mask))
    ref = np.array(attention_reference(q, k, v, 0.25, mask))
    assert np.isfinite(ours).all()  # even query rows that see no key (padding)
    seen = np.isfinite(ref)  # the fused op leaves such rows undefined
    np.testing.assert_allclose(ours[seen], ref[seen], atol=1e-5)
