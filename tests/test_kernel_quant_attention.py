"""Attention over quantized K/V (kernels/quant_attention.py, kernels/turboquant_attention.py):
affine round-trip bounds, fast path == reference, and output error against full precision
on random and outlier-heavy keys, per setting, with the bounds measured here."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.kernels.platform import Platform, use_platform
from deltaserve.kernels.quant_attention import (
    affine_attention,
    affine_attention_reference,
    dense_attention_reference,
    masked_softmax,
)
from deltaserve.kernels.turboquant import turboquant_quantize
from deltaserve.kernels.turboquant_attention import turboquant_attention

# Relative MSE of mx.quantize round trips on N(0, 1) rows of 128 (measured: 4-bit
# 0.0066 / 0.0083 / 0.0100 at g = 32 / 64 / 128; 8-bit 2.3e-5 / 2.9e-5 / 3.5e-5).
AFFINE_MSE_BOUND = {(4, 32): 0.0075, (4, 64): 0.0095, (4, 128): 0.0115}
AFFINE_MSE_BOUND |= {(8, 32): 2.7e-5, (8, 64): 3.4e-5, (8, 128): 4.1e-5}

# ||out - out_fp|| / ||out_fp|| of causal attention, B=2, Hq=8, Hkv=2, L=4, S=512, D=128,
# scale 1/sqrt(D), N(0, 1) q/k/v; "outliers": 4 key channels x10. Measured (random /
# outliers): affine-4 g64 0.132 / 0.353, affine-8 g64 0.0078 / 0.0236, TQ K8V3 0.184 /
# 0.178, K8V4 0.097 / 0.097, K4V4 0.139 / 0.238, K3V3 0.256 / 0.443, K8V8 0.009 / 0.014.
# On random data the output is an average of many values, so its relative error is about
# sqrt(value MSE): value bits dominate. Bounds: measured x 1.15.
SETTINGS = {
    "affine4": (0.152, 0.406),
    "affine8": (0.0090, 0.0272),
    "tq_k8v3": (0.212, 0.205),
    "tq_k8v4": (0.112, 0.112),
    "tq_k4v4": (0.160, 0.274),
    "tq_k3v3": (0.294, 0.510),
    "tq_k8v8": (0.0104, 0.0159),
}


def _qkv(outliers: bool, hq: int = 8, length: int = 4, s: int = 512, d: int = 128) -> tuple:
    mx.random.seed(0)
    q = mx.random.normal((2, hq, length, d))
    k = mx.random.normal((2, 2, s, d))
    v = mx.random.normal((2, 2, s, d))
    if outliers:
        k = k * mx.ones((d,)).at[mx.array([3, 40, 77, 100])].multiply(10.0)
    return q, k, v


def _attend(setting: str, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    if setting.startswith("affine"):
        bits = int(setting[-1])
        kq, vq = mx.quantize(k, 64, bits), mx.quantize(v, 64, bits)
        return affine_attention(q, *kq, *vq, scale, "causal", 64, bits)
    kb, vb = int(setting[4]), int(setting[6])
    kt, vt = turboquant_quantize(k, kb), turboquant_quantize(v, vb)
    return turboquant_attention(q, *kt, *vt, scale, "causal", kb, vb)


@pytest.mark.parametrize("bits,group", sorted(AFFINE_MSE_BOUND))
def test_affine_round_trip_error(bits: int, group: int) -> None:
    mx.random.seed(1)
    x = mx.random.normal((4096, 128))
    x_hat = mx.dequantize(*mx.quantize(x, group, bits), group_size=group, bits=bits)
    err = float(mx.sum((x - x_hat) ** 2) / mx.sum(x * x))
    assert err < AFFINE_MSE_BOUND[(bits, group)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hq,length", [(2, 1), (8, 1), (4, 7), (8, 9)])  # 9 x 4 rows: prefill
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool"])
def test_affine_attention_equals_reference(bits: int, hq: int, length: int, mask_kind: str) -> None:
    """quantized_matmul (decode) or dequantize + SDPA (prefill) == the reference."""
    q, k, v = _qkv(False, hq=hq, length=length, s=200, d=64)
    bool_mask = mx.random.uniform(shape=(2, 1, length, 200)) > 0.2
    mask = {"none": None, "causal": "causal", "bool": bool_mask}[mask_kind]
    kq, vq = mx.quantize(k, 32, bits), mx.quantize(v, 32, bits)
    args = (q, *kq, *vq, 0.125, mask, 32, bits)
    got, ref = affine_attention(*args), affine_attention_reference(*args)
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cuda_float32_never_calls_quantized_matmul(
    monkeypatch: pytest.MonkeyPatch, dtype: mx.Dtype
) -> None:
    """On CUDA, whose quantized_matmul has no float32 kernel (faked here: it raises as
    mlx-cuda does), float32 decode attention dequantizes and still equals the reference;
    half precision keeps quantized_matmul."""
    real = mx.quantized_matmul
    calls: list[mx.Dtype] = []

    def cuda_quantized_matmul(x: mx.array, *args: object, **kwargs: object) -> mx.array:
        calls.append(x.dtype)
        if x.dtype == mx.float32:
            raise RuntimeError("[quantized_matmul] No implementation for problem shape")
        return real(x, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", cuda_quantized_matmul)
    use_platform(Platform("cuda"))
    try:
        q, k, v = (x.astype(dtype) for x in _qkv(False, hq=4, length=1, s=200, d=64))
        kq, vq = mx.quantize(k, 32, 8), mx.quantize(v, 32, 8)
        args = (q, *kq, *vq, 0.125, "causal", 32, 8)
        got, ref = affine_attention(*args), affine_attention_reference(*args)
    finally:
        use_platform(None)
    assert calls == ([] if dtype == mx.float32 else [dtype, dtype])
    atol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)), atol=atol
    )


def test_fully_masked_query_row_is_finite_uniform() -> None:
    """A padding query that sees no key gets a uniform average (as mx.fast SDPA), not NaN."""
    scores = mx.random.normal((1, 1, 2, 3))
    mask = mx.array([[False, False, False], [True, False, True]])[None, None]
    probs = np.array(masked_softmax(scores, mask, 2))
    np.testing.assert_allclose(probs[0, 0, 0], [1 / 3] * 3, rtol=1e-6)
    assert probs[0, 0, 1, 1] == 0.0


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("outliers", [False, True], ids=["random", "outliers"])
def test_attention_error_against_full_precision(setting: str, outliers: bool) -> None:
    q, k, v = _qkv(outliers)
    scale = 128**-0.5
    ref = dense_attention_reference(q, k, v, scale, "causal")
    got = _attend(setting, q, k, v, scale)
    rel = float(mx.linalg.norm(got - ref) / mx.linalg.norm(ref))
    assert rel < SETTINGS[setting][int(outliers)]
