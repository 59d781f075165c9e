"""Gated-DeltaNet kernels (kernels/gated_delta.py) against the per-step float32 reference."""

from __future__ import annotations

import mlx.core as mx
import pytest

import deltaserve.kernels.gated_delta as gd
from deltaserve.kernels.gated_delta import (
    _gated_delta_fast,
    gated_delta,
    gated_delta_chunked,
    gated_delta_reference,
    gated_delta_step,
)
from deltaserve.kernels.platform import Platform, use_platform

# Absolute tolerance on y and on the state. Both are O(1) here: |k| = 1 and beta < 1 make
# each delta-rule step a contraction of S towards v ~ N(0, 1), and y = S q with |q| <= 1.
# So 1e-4 absolute is ~1e-4 relative; the bound is scaled by max(1, |ref|) in case a draw
# is larger. Measured errors are ~1e-7 on this CPU.
TOL = 1e-4

Inputs = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]


def make_inputs(
    b: int, length: int, hk: int, hv: int, d: int, seed: int = 0, nonzero_state: bool = True
) -> Inputs:
    """Realistic draws: unit q/k (q scaled by d**-0.5), g in about [-5, 0), beta in (0, 1)."""
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((b, length, hk, d), key=keys[0])
    k = mx.random.normal((b, length, hk, d), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * d**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((b, length, hv, d), key=keys[2])
    # -softplus(N(0, 2)): mostly in [-5, 0), a few gentle and a few strong decays.
    g = -mx.logaddexp(2.0 * mx.random.normal((b, length, hv), key=keys[3]), 0.0)
    beta = mx.sigmoid(2.0 * mx.random.normal((b, length, hv), key=keys[4]))
    state = mx.random.normal((b, hv, d, d), key=keys[5]) * 0.3
    if not nonzero_state:
        state = mx.zeros_like(state)
    return q, k, v, g, beta, state


def assert_close(got: tuple[mx.array, mx.array], ref: tuple[mx.array, mx.array]) -> None:
    """y and state within TOL * max(1, max |ref|)."""
    for name, a, r in zip(("y", "state"), got, ref, strict=True):
        assert a.shape == r.shape, (name, a.shape, r.shape)
        scale = max(1.0, mx.abs(r).max().item())
        err = mx.abs(a.astype(mx.float32) - r.astype(mx.float32)).max().item()
        assert err <= TOL * scale, f"{name}: max abs err {err:.3g} (scale {scale:.3g})"


def left_pad_mask(length: int, pads: list[int]) -> mx.array:
    """[B, L] bool: row i has pads[i] False entries on the left."""
    pos = mx.arange(length)[None, :]
    return pos >= mx.array(pads)[:, None]


def scattered_mask(b: int, length: int, seed: int = 1) -> mx.array:
    """[B, L] bool with ~30% False at random positions (first step always masked)."""
    m = mx.random.uniform(shape=(b, length), key=mx.random.key(seed)) > 0.3
    return mx.concatenate([mx.zeros((b, 1), mx.bool_), m[:, 1:]], axis=1)


SHAPES = [(2, 4, 32), (1, 2, 128)]  # (Hk, Hv, D): repeat-interleave with D=32; D=128


@pytest.mark.parametrize("hk,hv,d", SHAPES)
@pytest.mark.parametrize("length", [1, 5, 64, 130])
@pytest.mark.parametrize("nonzero_state", [False, True])
def test_chunked_and_dispatcher_match_reference(
    hk: int, hv: int, d: int, length: int, nonzero_state: bool
) -> None:
    x = make_inputs(2, length, hk, hv, d, seed=length, nonzero_state=nonzero_state)
    ref = gated_delta_reference(*x)
    assert_close(gated_delta_chunked(*x), ref)
    assert_close(gated_delta(*x), ref)
    if length == 1:
        assert_close(gated_delta_step(*x), ref)


@pytest.mark.parametrize("hk,hv,d", SHAPES)
@pytest.mark.parametrize("kind", ["left_pad", "scattered"])
@pytest.mark.parametrize("length", [5, 64, 130])
def test_masked_matches_reference(hk: int, hv: int, d: int, kind: str, length: int) -> None:
    x = make_inputs(2, length, hk, hv, d, seed=7 + length)
    mask = left_pad_mask(length, [3, 0]) if kind == "left_pad" else scattered_mask(2, length)
    ref = gated_delta_reference(*x, mask)
    for fn in (gated_delta_chunked, gated_delta):
        y, s = fn(*x, mask)
        assert_close((y, s), ref)
        # Masked steps give exactly y = 0.
        assert mx.all(mx.where(mask[..., None, None], 0.0, y) == 0).item()


@pytest.mark.parametrize("hk,hv,d", SHAPES)
def test_step_masked_rows(hk: int, hv: int, d: int) -> None:
    """Decode with one row of the batch masked: that row's state is bit-identical, y = 0."""
    x = make_inputs(3, 1, hk, hv, d, seed=11)
    mask = mx.array([[True], [False], [True]])
    ref = gated_delta_reference(*x, mask)
    y, s = gated_delta_step(*x, mask)
    assert_close((y, s), ref)
    assert mx.array_equal(s[1], x[5][1]).item()
    assert mx.all(y[1] == 0).item()


def _drop_front(x: Inputs, n: int) -> Inputs:
    """Drops the first n steps of q, k, v, g, beta; keeps the state."""
    return (*(t[:, n:] for t in x[:5]), x[5])


@pytest.mark.parametrize("npad,n_real", [(2, 5), (64, 64)])
def test_masked_steps_leave_state_bit_identical(npad: int, n_real: int) -> None:
    """State after [pad]*npad + x equals the state after x alone, bit for bit.

    Exact by construction for the per-step paths (reference, and the step path that decode
    uses) at any padding, and for the chunked path when the pads fill whole chunks (64 + 64:
    the pad chunk passes S through as 1*S + 0, and x's chunk is the same GEMMs on the same
    data). Pads that shift x INSIDE a chunk move its terms to other positions of the BLAS
    sums, which changes rounding only (~1e-7, asserted here and against the reference in
    test_masked_matches_reference); fully masked inputs are exact (test_all_masked...).
    """
    x = make_inputs(2, npad + n_real, 2, 4, 32, seed=5)
    mask = left_pad_mask(npad + n_real, [npad, npad])
    real = _drop_front(x, npad)
    exact = [gated_delta_reference] + ([gated_delta_chunked, gated_delta] if npad == 64 else [])
    for fn in (gated_delta_reference, gated_delta_chunked, gated_delta):
        y_pad, s_pad = fn(*x, mask)
        y_one, s_one = fn(*real)
        assert mx.all(y_pad[:, :npad] == 0).item()
        if fn in exact:
            assert mx.array_equal(s_pad, s_one).item(), fn.__name__
        else:
            assert mx.abs(s_pad - s_one).max().item() <= 1e-6, fn.__name__
    # Step path, token by token: pads are exact no-ops.
    s = x[5]
    s_alone = s
    for t in range(npad + n_real):
        step = tuple(a[:, t : t + 1] for a in x[:5])
        _, s = gated_delta_step(*step, s, mask[:, t : t + 1])
        if t >= npad:
            _, s_alone = gated_delta_step(*step, s_alone)
    assert mx.array_equal(s, s_alone).item()


@pytest.mark.parametrize("length", [3, 70])
def test_all_masked_is_identity(length: int) -> None:
    x = make_inputs(2, length, 2, 4, 32, seed=9)
    mask = mx.zeros((2, length), mx.bool_)
    for fn in (gated_delta_reference, gated_delta_chunked, gated_delta):
        y, s = fn(*x, mask)
        assert mx.array_equal(s, x[5]).item(), fn.__name__
        assert mx.all(y == 0).item()


@pytest.mark.parametrize("split", [1, 37, 64])
def test_two_calls_equal_one(split: int) -> None:
    """Chunked over [0, split) then [split, L) carrying the state == one call over L."""
    length = 130
    x = make_inputs(1, length, 2, 4, 32, seed=13)
    y_all, s_all = gated_delta_chunked(*x)
    first = (*(t[:, :split] for t in x[:5]), x[5])
    y1, s1 = gated_delta_chunked(*first)
    y2, s2 = gated_delta_chunked(*(t[:, split:] for t in x[:5]), s1)
    assert_close((mx.concatenate([y1, y2], axis=1), s2), (y_all, s_all))
    assert_close((y_all, s_all), gated_delta_reference(*x))


def test_correlated_keys_are_stable() -> None:
    """Identical keys, beta ~ 1, no decay: A is ~all-ones lower triangular.

    The Neumann-product inverse fails here (terms ~1e18 cancelling in float32); the block
    inverse must not.
    """
    b, length, d = 1, 128, 32
    x = make_inputs(b, length, 1, 1, d, seed=17)
    k = mx.broadcast_to(x[1][:, :1], x[1].shape)
    g = mx.zeros_like(x[3])
    beta = mx.full(x[4].shape, 0.99)
    xs = (x[0], k, x[2], g, beta, x[5])
    assert_close(gated_delta_chunked(*xs), gated_delta_reference(*xs))


@pytest.mark.parametrize("c", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("correlated", [False, True])
def test_block_inverse_matches_lapack(c: int, correlated: bool) -> None:
    """(I + A)^-1 by the block recursion (the Metal/CUDA path) equals LAPACK's trtri (the
    CPU path, mx.linalg.tri_inv), for random A and for A ~ all-ones lower triangular."""
    mx.random.seed(c)
    a = mx.full((2, 3, c, c), 0.99) if correlated else mx.random.normal((2, 3, c, c)) * 0.3
    a = mx.where(mx.tri(c, k=-1, dtype=mx.bool_), a, 0.0)
    blocks = gd._unit_lower_inverse_blocks(a)
    lapack = mx.linalg.tri_inv(a + mx.eye(c), upper=False, stream=mx.cpu)
    scale = float(mx.abs(lapack).max())
    assert float(mx.abs(blocks - lapack).max()) <= 1e-5 * scale


def test_correlated_keys_are_stable_with_the_block_inverse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked path with the GPU's block inverse, on the CPU, in the case above."""
    monkeypatch.setattr(gd, "_unit_lower_inverse", gd._unit_lower_inverse_blocks)
    test_correlated_keys_are_stable()


@pytest.mark.parametrize("length", [3, 41, 51, 100, 130])
@pytest.mark.parametrize("lapack", [True, False])
def test_short_chunks_of_any_size(
    monkeypatch: pytest.MonkeyPatch, length: int, lapack: bool
) -> None:
    """With LAPACK's inverse (the CPU) L tokens are the fewest equal chunks of <= 64 (a
    short input one chunk of L); with the block inverse chunks of a power of two. Both
    match the reference."""
    monkeypatch.setattr(gd, "_lapack_inverse", lambda: lapack)
    expect = {3: (3, 4), 41: (41, 64), 51: (51, 64), 100: (50, 64), 130: (44, 64)}[length]
    assert gd._chunk_size_for(length, 64, lapack) == expect[0 if lapack else 1]
    x = make_inputs(2, length, 2, 4, 32, seed=23 + length, nonzero_state=True)
    assert_close(gated_delta_chunked(*x), gated_delta_reference(*x))
    mask = left_pad_mask(length, [2, 0])
    assert_close(gated_delta_chunked(*x, mask), gated_delta_reference(*x, mask))


def test_strong_decay_flush() -> None:
    """Decays down to e^-40 per step (products underflow inside a chunk) still match."""
    x = make_inputs(1, 130, 2, 4, 32, seed=19)
    g = x[3] * 8.0
    xs = (x[0], x[1], x[2], g, x[4], x[5])
    assert_close(gated_delta_chunked(*xs), gated_delta_reference(*xs))


def test_fast_builtin_convention() -> None:
    """The Metal path's call (gamma = exp(g), state [B, Hv, Dv, Dk], Hk -> Hv expansion)
    agrees with the reference; on CPU mx.fast.gated_delta_update runs its op fallback."""
    x = make_inputs(2, 9, 2, 4, 32, seed=23)
    assert_close(_gated_delta_fast(*x), gated_delta_reference(*x))


def test_dtypes_and_default_state() -> None:
    """y comes back in v.dtype, state in float32; state=None means zeros."""
    q, k, v, g, beta, state = make_inputs(1, 6, 2, 4, 32, seed=29, nonzero_state=False)
    y, s = gated_delta(q, k, v.astype(mx.bfloat16), g, beta, None)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    assert y.shape == (1, 6, 4, 32) and s.shape == state.shape
    y_ref, s_ref = gated_delta_reference(q, k, v.astype(mx.bfloat16), g, beta, state)
    assert_close((y.astype(mx.float32), s), (y_ref.astype(mx.float32), s_ref))


def test_bad_shapes_raise() -> None:
    x = make_inputs(1, 4, 3, 4, 32)
    with pytest.raises(ValueError):
        gated_delta_chunked(*x)
    x = make_inputs(1, 4, 2, 4, 32)
    with pytest.raises(ValueError):
        gated_delta_step(*x)
    with pytest.raises(ValueError):
        gated_delta_chunked(*x, chunk_size=48)


@pytest.mark.parametrize(
    "hk,hv,d,masked,expect",
    [
        (16, 32, 128, False, "fast"),
        (16, 32, 128, True, "chunked"),  # mx.fast would loop per token with a mask
        (16, 16, 128, False, "chunked"),  # not a Metal-kernel head pair on mlx 0.32.4
        (2, 4, 32, False, "chunked"),  # Dk != 128
    ],
)
def test_dispatch_on_metal(
    monkeypatch: pytest.MonkeyPatch, hk: int, hv: int, d: int, masked: bool, expect: str
) -> None:
    """On a Metal profile the dispatcher uses mx.fast only where it has a real kernel;
    everything else goes to the chunked path, never to a per-token loop; decode (L = 1)
    goes to the fused step."""
    calls: list[str] = []
    use_platform(Platform("metal"))
    monkeypatch.setattr(gd, "_gated_delta_fast", lambda *a: calls.append("fast") or a[:2])
    monkeypatch.setattr(gd, "gated_delta_chunked", lambda *a: calls.append("chunked") or a[:2])
    monkeypatch.setattr(gd, "gated_delta_step_fused", lambda *a: calls.append("step") or a[:2])
    x = make_inputs(1, 3, hk, hv, d)
    gd.gated_delta(*x, mx.ones((1, 3), mx.bool_) if masked else None)
    gd.gated_delta(*(t[:, :1] for t in x[:5]), x[5])
    assert calls == [expect, "step"]


def test_empty_sequence() -> None:
    x = make_inputs(1, 0, 2, 4, 32)
    y, s = gated_delta(*x)
    assert y.shape == (1, 0, 4, 32) and mx.array_equal(s, x[5]).item()
