"""Row-wise argmax (kernels/argmax.py): the host path against mx.argmax on random inputs.

On the CPU `argmax_rows(..., lazy=False)` evaluates the scores and reduces them with numpy;
it must pick the same index as the reference, the first maximum, on every dtype the sampler
sees, with ties and masked (-inf) entries. The sampler's greedy rows use it through
Sampler(lazy_tokens=False), as a lockstep engine builds it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.engine.sampling.sampler import Sampler, SamplingRow
from deltaserve.engine.types import SamplingParams
from deltaserve.kernels.argmax import argmax_reference, argmax_rows


def _scores(rows: int, vocab: int, dtype: mx.Dtype, seed: int) -> mx.array:
    return (4.0 * mx.random.normal((rows, vocab), key=mx.random.key(seed))).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (3, 1000), (32, 248320), (5, 4097)])
def test_matches_reference(dtype: mx.Dtype, shape: tuple[int, int]) -> None:
    scores = _scores(*shape, dtype, seed=shape[1])
    got = argmax_rows(scores, lazy=False)
    assert got.dtype == mx.int32 and got.shape == (shape[0],)
    assert got.tolist() == argmax_reference(scores).tolist()


def test_ties_masks_and_lazy() -> None:
    """First maximum on ties (coarse bf16 values tie often), -inf masks, equal rows."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(6, 3000)).astype(np.float32)  # many tied maxima
    x[1] = -np.inf
    x[1, [17, 2900]] = 5.0  # two allowed tokens, tied
    x[2] = 0.0  # every entry ties
    x[3, -1] = 9.0  # the last column
    scores = mx.array(x)
    want = np.argmax(x, axis=-1).tolist()
    assert want[1:4] == [17, 0, 2999]
    assert argmax_rows(scores, lazy=False).tolist() == want
    assert argmax_rows(scores.astype(mx.bfloat16), lazy=False).tolist() == want
    assert argmax_rows(scores, lazy=True).tolist() == want  # the graph node: mx.argmax


def test_views() -> None:
    """Transposed, strided, sliced and broadcast scores read the same on the host."""
    x = _scores(300, 40, mx.float32, seed=5)
    for view in (x.T, x[::2], x[:, 5:30], mx.broadcast_to(x[:1], (4, 40))):
        assert argmax_rows(view, lazy=False).tolist() == argmax_reference(view).tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampler_host_tokens_equal_lazy_tokens(temperature: float) -> None:
    """Greedy and Gumbel-max draws pick the same tokens either way (seeded rows)."""
    logits = _scores(6, 5000, mx.float32, seed=3)
    rows = [
        SamplingRow(SamplingParams(temperature=temperature, seed=i), (1, 2), [3] * i)
        for i in range(6)
    ]
    lazy = Sampler(lazy_tokens=True).sample(logits, rows).tokens.tolist()
    host = Sampler(lazy_tokens=False).sample(logits, rows).tokens.tolist()
    assert host == lazy
