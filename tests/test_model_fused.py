"""Fused projections (models/fused.py) compute exactly what their parts computed."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from deltaserve.models.fused import fuse


def _parts(quantized: bool, sizes: list[int]) -> list[nn.Module]:
    mx.random.seed(0)
    parts = [nn.Linear(64, n, bias=False) for n in sizes]
    if quantized:
        parts = [nn.QuantizedLinear.from_linear(p, group_size=32, bits=4) for p in parts]
    return parts


@pytest.mark.parametrize("quantized", [False, True])
def test_fused_outputs_equal_the_parts(quantized: bool) -> None:
    """Each split of the fused matmul equals its part's output (odd sizes included)."""
    parts = _parts(quantized, [96, 32, 3, 5])
    fused = fuse(parts)
    assert fused is not None
    x = mx.random.normal((2, 7, 64))
    for got, part in zip(fused(x), parts, strict=True):
        assert got.shape == (2, 7, part.weight.shape[0])
        assert mx.allclose(got, part(x), atol=1e-5, rtol=1e-5).item()


def test_parts_that_cannot_share_a_matmul_stay_apart() -> None:
    """Mixed bits, mixed kinds or a bias: no fusion (the layer keeps its parts)."""
    four = _parts(True, [32])[0]
    eight = nn.QuantizedLinear.from_linear(nn.Linear(64, 32, bias=False), group_size=32, bits=8)
    assert fuse([four, eight]) is None
    assert fuse([four, nn.Linear(64, 32, bias=False)]) is None
    assert fuse([nn.Linear(64, 32), nn.Linear(64, 32)]) is None
