"""TurboQuant codec (kernels/turboquant.py): codebooks, rotation, packing, round-trip error,
and the rotated-space attention against its dequantize-then-attend reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.kernels.turboquant import (
    lloyd_max_codebook,
    pack_indices,
    rotate,
    turboquant_dequantize,
    turboquant_quantize,
    unpack_indices,
    unrotate,
)
from deltaserve.kernels.turboquant_attention import (
    turboquant_attention,
    turboquant_attention_dequantized,
    turboquant_attention_reference,
)

# Paper / reference §5.2: D_mse of a unit vector at 1..4 bits.
PAPER_MSE = {1: 0.363, 2: 0.118, 3: 0.0345, 4: 0.0095}
# Reference §5.2: positive half of the d = 256 codebooks (units of 1/sqrt(d)).
PAPER_CENTROIDS = {1: [0.7986], 2: [0.4526, 1.5077], 3: [0.2447, 0.7545, 1.3400, 2.1415]}


def _relative_mse(x: mx.array, bits: int) -> float:
    codes, norms = turboquant_quantize(x, bits)
    x_hat = turboquant_dequantize(codes, norms, bits, x.shape[-1])
    err = mx.sum((x - x_hat) ** 2, axis=-1) / mx.sum(x * x, axis=-1)
    return float(mx.mean(err))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", range(1, 9))
def test_codebooks_sorted_and_symmetric(d: int, bits: int) -> None:
    c = lloyd_max_codebook(d, bits)
    assert c.shape == (1 << bits,)
    assert np.all(np.diff(c) > 0)
    np.testing.assert_array_equal(c, -c[::-1])


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_codebook_matches_published_centroids(bits: int) -> None:
    positive = lloyd_max_codebook(256, bits)[1 << (bits - 1) :]
    np.testing.assert_allclose(positive, PAPER_CENTROIDS[bits], rtol=2e-3)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_round_trip_error_matches_paper(d: int, bits: int) -> None:
    """E||x - x^||^2 / ||x||^2 on Gaussian vectors within 5% of the paper's D_mse."""
    mx.random.seed(bits)
    x = mx.random.normal((4096, d)) * 3.0  # any scale: the norm is stored separately
    assert abs(_relative_mse(x, bits) / PAPER_MSE[bits] - 1) < 0.05


def test_outlier_channels_do_not_hurt() -> None:
    """The rotation spreads a few x10 channels over all coordinates: error stays the same."""
    mx.random.seed(0)
    x = mx.random.normal((4096, 128))
    boost = mx.ones((128,)).at[mx.array([3, 40, 77, 100])].multiply(10.0)
    for bits in (2, 3, 4):
        assert _relative_mse(x * boost, bits) < 1.1 * _relative_mse(x, bits)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trip_and_size(bits: int) -> None:
    d = 128
    idx = mx.random.randint(0, 1 << bits, (3, 5, d)).astype(mx.uint32)
    packed = pack_indices(idx, bits)
    assert packed.dtype == mx.uint32 and packed.nbytes == 3 * 5 * d * bits // 8
    assert mx.array_equal(unpack_indices(packed, bits, d), idx)


def test_rotation_is_orthonormal_and_inverted() -> None:
    x = mx.random.normal((7, 256))
    y = rotate(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.array(unrotate(y)), np.array(x), atol=1e-5)


def test_zero_vector_round_trips_to_zero() -> None:
    codes, norms = turboquant_quantize(mx.zeros((2, 64)), 3)
    assert mx.array_equal(turboquant_dequantize(codes, norms, 3, 64), mx.zeros((2, 64)))


def _quantized_inputs(kb: int, vb: int, length: int, hq: int) -> tuple:
    mx.random.seed(kb * 10 + vb)
    b, hkv, s, d = 2, 2, 300, 64
    q = mx.random.normal((b, hq, length, d))
    k = turboquant_quantize(mx.random.normal((b, hkv, s, d)), kb)
    v = turboquant_quantize(mx.random.normal((b, hkv, s, d)), vb)
    mask = mx.random.uniform(shape=(b, 1, length, s)) > 0.2
    return q, k, v, mask


@pytest.mark.parametrize("kb,vb", [(8, 3), (4, 4), (3, 3), (2, 5)])
@pytest.mark.parametrize("length,hq", [(1, 2), (1, 8), (6, 4)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool"])
def test_rotated_attention_equals_reference(
    kb: int, vb: int, length: int, hq: int, mask_kind: str
) -> None:
    """Attention in the rotated space == dequantize everything, then attend."""
    q, k, v, bool_mask = _quantized_inputs(kb, vb, length, hq)
    mask = {"none": None, "causal": "causal", "bool": bool_mask}[mask_kind]
    args = (q, *k, *v, 0.125, mask, kb, vb)
    ref = np.array(turboquant_attention_reference(*args))
    np.testing.assert_allclose(np.array(turboquant_attention(*args)), ref, atol=2e-5)
    np.testing.assert_allclose(np.array(turboquant_attention_dequantized(*args)), ref, atol=2e-5)
