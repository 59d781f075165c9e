"""RMSNorm with float32 gains (kernels/rms_norm.py) against its references.

On CPU `rms_norm` runs its ops path, which is checked here against float64 numpy. On a
CUDA or Metal machine (`python -m pytest tests/test_kernel_rms_norm.py`) the `gpu` tests
hold the kernel to the ops path.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.kernels.rms_norm import float_bits, rms_norm, rms_norm_ops

HAS_GPU = mx.default_device().type == mx.DeviceType.gpu
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA or Metal GPU as default device")

SHAPES = [(1, 1024), (3, 7, 256), (64, 4096), (5, 1000), (2, 1, 16, 128)]


def make(shape: tuple[int, ...], dtype: mx.Dtype, seed: int = 0) -> tuple[mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(seed), 2)
    x = (3.0 * mx.random.normal(shape, key=keys[0])).astype(dtype)
    weight = 1.0 + 0.1 * mx.random.normal((shape[-1],), key=keys[1])
    return x, weight


def numpy_reference(x: mx.array, weight: mx.array, eps: float) -> np.ndarray:
    xs = np.array(x.astype(mx.float32), dtype=np.float64)
    scale = 1.0 / np.sqrt((xs * xs).mean(axis=-1, keepdims=True) + eps)
    return np.array(weight, dtype=np.float64) * xs * scale


# float32: another summation order; half precision: the result's own rounding (bf16 2^-8).
TOL = {mx.float32: 1e-5, mx.bfloat16: 2**-7, mx.float16: 2**-10}


def assert_close(got: mx.array, ref: np.ndarray, dtype: mx.Dtype) -> None:
    assert got.dtype == dtype
    err = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - ref)
    assert (err <= TOL[dtype] * np.maximum(1.0, np.abs(ref))).all(), float(err.max())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_float64(shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    x, weight = make(shape, dtype)
    assert_close(rms_norm(x, weight, 1e-6), numpy_reference(x, weight, 1e-6), dtype)


def test_empty_input_and_weight_shape() -> None:
    x, weight = make((0, 64), mx.bfloat16)
    assert rms_norm(x, weight, 1e-6).shape == (0, 64)
    if HAS_GPU:
        with pytest.raises(ValueError, match="weight"):
            rms_norm(make((2, 64), mx.bfloat16)[0], weight[:32], 1e-6)


@gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_ops(shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    x, weight = make(shape, dtype, seed=len(shape))
    got, ref = rms_norm(x, weight, 1e-6), rms_norm_ops(x, weight, 1e-6)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    diff = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))
    bound = TOL[dtype] * mx.maximum(1.0, mx.abs(ref.astype(mx.float32)))
    assert mx.all(diff <= bound).item(), diff.max().item()


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 1e-12, 0.1])
def test_float_bits_are_float32s(eps: float) -> None:
    """The kernels' eps template argument: float32(eps)'s bits, without an MLX op."""
    assert float_bits(eps) == mx.array(eps, mx.float32).view(mx.int32).item()
