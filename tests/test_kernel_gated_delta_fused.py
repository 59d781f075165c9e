"""Fused Gated-DeltaNet decode step (kernels/gated_delta_fused.py) against the reference.

On CPU these exercise the wrapper and its ops path; on a CUDA or Metal machine the same
tests run the kernel (`python -m pytest tests/test_kernel_gated_delta_fused.py`), and the
tests marked `gpu` check that the kernel, not the ops path, was what ran.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import deltaserve.kernels.gated_delta_fused as fused
from deltaserve.kernels.gated_delta import gated_delta_reference
from deltaserve.kernels.gated_delta_fused import gated_delta_step_fused
from deltaserve.kernels.platform import Platform, use_platform

HAS_GPU = mx.default_device().type == mx.DeviceType.gpu
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA or Metal GPU as default device")

# State and float32 y: the kernel sums in float32 in another order than the reference
# (~1e-6 measured); scaled by max(1, |ref|). Half-precision y: one bf16 ulp is 2^-8.
TOL = {mx.float32: 1e-4, mx.bfloat16: 1e-2, mx.float16: 2e-3}

Inputs = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]


def make_inputs(
    b: int, hk: int, hv: int, dk: int, dv: int, dtype: mx.Dtype = mx.float32, seed: int = 0
) -> Inputs:
    """One decode step: unit q/k (q scaled by dk**-0.5), g ~ -softplus, beta in (0, 1)."""
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((b, 1, hk, dk), key=keys[0])
    k = mx.random.normal((b, 1, hk, dk), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((b, 1, hv, dv), key=keys[2])
    g = -mx.logaddexp(2.0 * mx.random.normal((b, 1, hv), key=keys[3]), 0.0)
    beta = mx.sigmoid(2.0 * mx.random.normal((b, 1, hv), key=keys[4]))
    state = mx.random.normal((b, hv, dv, dk), key=keys[5]) * 0.3
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    return q, k, v, g, beta, state


def assert_close(got: tuple[mx.array, mx.array], ref: tuple[mx.array, mx.array]) -> None:
    """Same shapes and dtypes; y and state within TOL[dtype] * max(1, max |ref|)."""
    for name, a, r in zip(("y", "state"), got, ref, strict=True):
        assert (a.shape, a.dtype) == (r.shape, r.dtype), (name, a.shape, a.dtype, r.dtype)
        scale = max(1.0, mx.abs(r).max().item())
        err = mx.abs(a.astype(mx.float32) - r.astype(mx.float32)).max().item()
        assert err <= TOL[r.dtype] * scale, f"{name}: max abs err {err:.3g} (scale {scale:.3g})"


def row_mask(b: int, seed: int = 1) -> mx.array:
    """[B, 1] bool, about 30% False, row 0 always False and row 1 (if any) True."""
    m = mx.random.uniform(shape=(b, 1), key=mx.random.key(seed)) > 0.3
    m[0] = False
    if b > 1:
        m[1] = True
    return m


# (B, Hk, Hv, Dk, Dv): Hk == Hv, repeat-interleave, Dv not a multiple of a block's 16 rows,
# the 0.8B and 9B layer shapes.
SHAPES = [(1, 2, 2, 32, 32), (3, 2, 4, 32, 32), (2, 1, 2, 64, 40), (8, 16, 16, 128, 128)]
SHAPES_BIG = [(64, 16, 16, 128, 128), (64, 16, 32, 128, 128)]


@pytest.mark.parametrize("shape", SHAPES + (SHAPES_BIG if HAS_GPU else []))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(shape: tuple[int, ...], dtype: mx.Dtype, masked: bool) -> None:
    """y (in v.dtype) and the float32 state match the per-step float32 reference."""
    x = make_inputs(*shape, dtype=dtype, seed=sum(shape))
    mask = row_mask(shape[0]) if masked else None
    assert_close(gated_delta_step_fused(*x, mask), gated_delta_reference(*x, mask))


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_masked_rows_exact(shape: tuple[int, ...]) -> None:
    """A masked row keeps its state bit for bit and gets y = 0 exactly."""
    x = make_inputs(*shape, seed=3)
    mask = row_mask(shape[0])
    y, s = gated_delta_step_fused(*x, mask)
    off = mx.logical_not(mask[:, 0])
    assert mx.all(mx.where(off[:, None, None, None], s == x[5], True)).item()
    assert mx.all(mx.where(off[:, None, None, None], y == 0, True)).item()


def test_float16_and_default_state() -> None:
    """float16 inputs give float16 y; state=None means zeros."""
    q, k, v, g, beta, state = make_inputs(2, 2, 4, 32, 32, dtype=mx.float16, seed=5)
    y, s = gated_delta_step_fused(q, k, v, g, beta, None)
    ref = gated_delta_reference(q, k, v, g, beta, mx.zeros_like(state))
    assert y.dtype == mx.float16 and s.dtype == mx.float32
    assert_close((y, s), ref)


def test_bad_shapes_raise() -> None:
    q, k, v, g, beta, s = make_inputs(1, 3, 4, 32, 32)
    with pytest.raises(ValueError):  # Hv not a multiple of Hk
        gated_delta_step_fused(q, k, v, g, beta, s)
    q, k, v, g, beta, s = make_inputs(1, 2, 4, 32, 32)
    two = [mx.concatenate([t, t], axis=1) for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError):  # L = 2
        gated_delta_step_fused(*two, s)
    q, k, v, g, beta, s = make_inputs(1, 2, 4, 48, 32)
    with pytest.raises(ValueError):  # the kernels need Dk % 32 == 0 (checked before launch)
        fused._gpu_step("cuda", q, k, v, g, beta, s, None)


@pytest.mark.parametrize("kind", ["cuda", "metal"])
def test_dispatch_to_gpu_kernel(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """With a GPU profile the wrapper goes to the kernel launcher, state None -> zeros and
    a bf16 state -> float32; on CPU it takes the ops path."""
    calls: list[tuple] = []
    use_platform(Platform(kind, fused_gated_delta_step=True))
    monkeypatch.setattr(fused, "_gpu_step", lambda *a: calls.append(a) or (a[3], a[6]))
    q, k, v, g, beta, s = make_inputs(2, 2, 4, 32, 32)
    gated_delta_step_fused(q, k, v, g, beta, None)
    gated_delta_step_fused(q, k, v, g, beta, s.astype(mx.bfloat16), mx.ones((2, 1), mx.bool_))
    assert [c[0] for c in calls] == [kind, kind]
    assert mx.array_equal(calls[0][6], mx.zeros_like(s)).item()
    assert calls[1][6].dtype == mx.float32 and calls[1][7] is not None


@gpu
def test_gpu_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the kernel path is taken (not the ops fallback) and matches the reference."""
    monkeypatch.setattr(fused, "gated_delta_step", None)  # any use of the ops path fails
    x = make_inputs(8, 16, 32, 128, 128, dtype=mx.bfloat16, seed=7)
    mask = row_mask(8)
    assert_close(gated_delta_step_fused(*x, mask), gated_delta_reference(*x, mask))


@gpu
def test_gpu_unaligned_state_and_compile() -> None:
    """A row-contiguous state view at a 4-byte offset (scalar-load path) and the kernel
    inside mx.compile both match the reference."""
    q, k, v, g, beta, s = make_inputs(4, 2, 4, 128, 128, seed=9)
    flat = mx.concatenate([mx.zeros((1,)), s.reshape(-1)])
    view = flat[1:].reshape(s.shape)
    ref = gated_delta_reference(q, k, v, g, beta, s)
    assert_close(gated_delta_step_fused(q, k, v, g, beta, view), ref)
    assert_close(mx.compile(gated_delta_step_fused)(q, k, v, g, beta, s), ref)


@gpu
def test_gpu_decode_chain() -> None:
    """Twenty steps carrying the state (masks changing per step) stay within tolerance."""
    b, hk, hv, d = 4, 2, 4, 128
    s_fused = s_ref = make_inputs(b, hk, hv, d, d)[5]
    for t in range(20):
        q, k, v, g, beta, _ = make_inputs(b, hk, hv, d, d, dtype=mx.bfloat16, seed=100 + t)
        mask = row_mask(b, seed=t)
        y, s_fused = gated_delta_step_fused(q, k, v, g, beta, s_fused, mask)
        y_ref, s_ref = gated_delta_reference(q, k, v, g, beta, s_ref, mask)
    assert_close((y, s_fused), (y_ref, s_ref))
