"""kernels/fastmath.py against MLX's native ops on random and extreme inputs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from deltaserve.kernels import fastmath


def _inputs() -> mx.array:
    mx.random.seed(0)
    wide = mx.random.normal((4096,)) * 10.0
    edges = mx.array([-100.0, -88.0, -30.0, -1e-6, 0.0, 1e-6, 30.0, 80.0, 100.0])
    return mx.concatenate([wide, edges])


def test_exp_matches_reference() -> None:
    """Relative error <= 2e-6 where e^x is a normal float32 (|x| <= 80)."""
    x = _inputs()
    keep = np.array(mx.abs(x) <= 80)
    ours, ref = np.array(fastmath.exp(x))[keep], np.array(fastmath.exp_reference(x))[keep]
    rel = np.abs(ours - ref) / np.maximum(np.abs(ref), 1e-30)
    assert rel.max() <= 2e-6


def test_sigmoid_and_silu_match_reference() -> None:
    """Absolute error <= 1e-6 on sigmoid, saturation exact at +-100, silu consistent."""
    x = _inputs()
    ours, ref = np.array(fastmath.sigmoid(x)), np.array(fastmath.sigmoid_reference(x))
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    assert ours[-1] == 1.0 and ours[-9] == 0.0
    np.testing.assert_allclose(np.array(fastmath.silu(x)), np.array(x) * ref, rtol=2e-6, atol=1e-6)
