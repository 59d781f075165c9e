"""Routed MoE experts in two CUDA kernels (kernels/moe_experts.py) against references.

On CPU: the plain-MLX `reference` equals the model's gathered path (QuantizedSwitchExperts
through gather_qmm, weighted and summed over k). On a CUDA machine (`python -m pytest
tests/test_kernel_moe_experts.py` there) the kernel is compared to the reference, and
SparseMoE with the kernel to SparseMoE without it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import deltaserve.kernels.moe_experts as moe
from deltaserve.models.layers import QuantizedSwitchExperts, SparseMoE

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU as default device")
SPEC = {"group_size": 64, "bits": 4, "mode": "affine"}


def make_experts(num: int, hidden: int, inter: int, group_size: int = 64, seed: int = 0):
    spec = {**SPEC, "group_size": group_size}
    experts = QuantizedSwitchExperts(
        num, hidden, inter, dict.fromkeys(("gate_proj", "up_proj", "down_proj"), spec)
    )
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        shape = (num, hidden, inter) if name == "down_proj" else (num, inter, hidden)
        weight = mx.random.normal(shape, key=mx.random.key(seed + i)) * 0.05
        for attr, value in zip(
            ("weight", "scales", "biases"), mx.quantize(weight, **spec), strict=True
        ):
            experts[name][attr] = value
    return experts


def make_inputs(tokens: int, num: int, hidden: int, k: int, dtype: mx.Dtype, seed: int = 1):
    x = (mx.random.normal((tokens, hidden), key=mx.random.key(seed)) * 0.5).astype(dtype)
    scores = mx.random.uniform(shape=(tokens, num), key=mx.random.key(seed + 1))
    indices = mx.argsort(scores, axis=-1)[:, :k].astype(mx.uint32)
    weights = mx.softmax(mx.take_along_axis(scores, indices, axis=-1) * 4, axis=-1)
    return x, indices, weights


def gathered(x, indices, weights, experts) -> mx.array:
    """The model's path without the kernel (SparseMoE's else branch)."""
    return (experts(x, indices) * weights[..., None].astype(x.dtype)).sum(axis=1)


def assert_close(got: mx.array, ref: mx.array, tol: float) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
    scale = mx.abs(ref.astype(mx.float32)).max().item()
    err = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert err <= tol * scale, f"max abs err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_reference_equals_gathered_path(tokens: int) -> None:
    """float32: same values as gather_qmm + weighted sum (1e-5 of the largest output)."""
    experts = make_experts(16, 128, 64)
    x, indices, weights = make_inputs(tokens, 16, 128, 4, mx.float32)
    assert_close(
        moe.reference(x, indices, weights, experts), gathered(x, indices, weights, experts), 1e-5
    )


def test_not_supported_off_cuda_or_too_many_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = make_experts(8, 128, 64)
    assert not moe.supported(experts, 8) or moe.ENABLED
    monkeypatch.setattr(moe, "ENABLED", True)
    assert moe.supported(experts, 8) == ON_CUDA
    assert not moe.supported(experts, moe.MAX_ROWS + 1)


@cuda
@pytest.mark.parametrize(
    ("tokens", "num", "hidden", "inter", "k", "group_size"),
    [(1, 256, 2048, 512, 8, 64), (16, 256, 2048, 512, 8, 64), (3, 16, 256, 128, 4, 32),
     (7, 16, 256, 128, 2, 128)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_kernel_equals_reference(
    monkeypatch: pytest.MonkeyPatch, tokens, num, hidden, inter, k, group_size, dtype
) -> None:
    """(float32 scales: the gathered path then returns float32, compared after a cast.)"""
    monkeypatch.setattr(moe, "ENABLED", True)
    experts = make_experts(num, hidden, inter, group_size)
    x, indices, weights = make_inputs(tokens, num, hidden, k, dtype)
    assert moe.supported(experts, indices.size)
    got = moe.moe_experts(x, indices, weights, experts)
    tol = 1e-2 if dtype == mx.bfloat16 else 1e-4
    assert_close(got, moe.reference(x, indices, weights, experts), tol)
    assert_close(got, gathered(x, indices, weights, experts).astype(dtype), 2 * tol)


@cuda
def test_sparse_moe_with_and_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SparseMoE block (router, shared expert) gives the same output either way."""
    block = SparseMoE(256, 16, 4, 128, 128, norm=True)
    block.experts = make_experts(16, 256, 128)
    mx.eval(block.parameters())
    x = (mx.random.normal((6, 256), key=mx.random.key(3)) * 0.5).astype(mx.bfloat16)
    block.set_dtype(mx.bfloat16)
    monkeypatch.setattr(moe, "ENABLED", True)
    with_kernel = block(x)
    monkeypatch.setattr(moe, "ENABLED", False)
    assert_close(with_kernel, block(x), 2e-2)
