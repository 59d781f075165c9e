"""Row ops of the quantized stores (affine, TurboQuant, and the full-precision prefix
wrapper): merge / filter / extract keep every row equal to the same row stored alone,
batched attention equals per-row attention, and the byte formulas match the arrays."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.engine.cache.factory import AnyKV, kv_bytes_per_element_pair, kv_store_factory
from deltaserve.engine.cache.kv import FullPrecisionKV
from deltaserve.engine.cache.start_precision import PrefixKV
from deltaserve.engine.config import KVCacheConfig

HKV, HQ, D = 2, 4, 64
# Same rows, same quantized bytes; only float32 reductions over a different batch shape
# (and padding columns) differ.
ATOL = 2e-5

KINDS = {
    "affine4": KVCacheConfig(kind="affine", bits=4, group_size=32),
    "affine8": KVCacheConfig(kind="affine", bits=8),
    "tq_k8v3": KVCacheConfig(kind="turboquant"),
    "tq_k3v5": KVCacheConfig(kind="turboquant", key_bits=3, value_bits=5),
    "affine8_start4": KVCacheConfig(kind="affine", bits=8, start=4),
    "tq_start4": KVCacheConfig(kind="turboquant", key_bits=4, value_bits=4, start=4),
}


@pytest.fixture(params=sorted(KINDS))
def config(request: pytest.FixtureRequest) -> KVCacheConfig:
    return KINDS[request.param]


def _row_store(config: KVCacheConfig, length: int, seed: int) -> AnyKV:
    """A B=1 store filled with `length` random tokens (in two appends when possible)."""
    mx.random.seed(seed)
    keys = mx.random.normal((1, HKV, length, D))
    values = mx.random.normal((1, HKV, length, D))
    store = kv_store_factory(config)()
    split = length // 2
    for lo, hi in ((0, split), (split, length)):
        if hi > lo:
            q = mx.random.normal((1, HQ, hi - lo, D))
            store.attend(q, keys[:, :, lo:hi], values[:, :, lo:hi], 0.125, None)
    return store


def _row_content(store: AnyKV, row: int) -> list[np.ndarray]:
    """Everything stored for one row's real tokens (prefix part first, if any)."""
    out = []
    if isinstance(store, PrefixKV):
        out = [np.array(a[row, :, : store.plen[row]]) for a in store.prefix]
        store = store.inner
    pad = store.left_pad[row]
    return out + [np.array(a[row, :, pad : store.size]) for a in store.arrays]


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def _merged(config: KVCacheConfig, lengths: list[int]) -> tuple[AnyKV, list[list[np.ndarray]]]:
    batch = kv_store_factory(config)()
    rows = [_row_store(config, n, seed=i) for i, n in enumerate(lengths)]
    for store in rows:
        batch.merge(store)
    return batch, [_row_content(r, 0) for r in rows]


@pytest.mark.parametrize("lengths", [[5, 9, 1], [7], [12, 1, 6, 2]])
def test_merge_keeps_every_row(config: KVCacheConfig, lengths: list[int]) -> None:
    batch, originals = _merged(config, lengths)
    assert batch.lengths() == lengths
    for row, content in enumerate(originals):
        _assert_same(_row_content(batch, row), content)


def test_filter_extract_round_trip(config: KVCacheConfig) -> None:
    batch, originals = _merged(config, [4, 10, 6])
    batch.filter([2, 0])
    assert batch.lengths() == [6, 4]
    _assert_same(_row_content(batch, 0), originals[2])
    single = batch.extract(1)
    assert single.lengths() == [4]
    _assert_same(_row_content(single, 0), originals[0])
    batch.filter([0])  # the extracted row is independent of the batch
    _assert_same(_row_content(single, 0), originals[0])
    batch.filter([])
    assert batch.num_rows == 0
    batch.merge(single)
    _assert_same(_row_content(batch, 0), originals[0])


def test_batched_attention_equals_each_row_alone(config: KVCacheConfig) -> None:
    """One decode step over a left-padded batch equals the same step per row."""
    lengths = [3, 8, 1, 5]
    batch, _ = _merged(config, lengths)
    alone = [_row_store(config, n, seed=i) for i, n in enumerate(lengths)]
    mx.random.seed(99)
    q = mx.random.normal((len(lengths), HQ, 1, D))
    k = mx.random.normal((len(lengths), HKV, 1, D))
    v = mx.random.normal((len(lengths), HKV, 1, D))
    out = batch.attend(q, k, v, 0.125, None)
    for row, store in enumerate(alone):
        ref = store.attend(q[row : row + 1], k[row : row + 1], v[row : row + 1], 0.125, None)
        np.testing.assert_allclose(np.array(out[row]), np.array(ref[0]), atol=ATOL)


def test_left_padded_prefill_matches_unpadded(config: KVCacheConfig) -> None:
    mx.random.seed(3)
    q = mx.random.normal((2, HQ, 7, D))
    k = mx.random.normal((2, HKV, 7, D))
    v = mx.random.normal((2, HKV, 7, D))
    out = kv_store_factory(config)().attend(q, k, v, 0.125, (0, 5))
    for row, n in enumerate([7, 2]):
        part = (a[row : row + 1, :, 7 - n :] for a in (q, k, v))
        ref = kv_store_factory(config)().attend(*part, 0.125, None)
        np.testing.assert_allclose(np.array(out[row, :, 7 - n :]), np.array(ref[0]), atol=ATOL)


def test_chunking_does_not_change_attention(config: KVCacheConfig) -> None:
    """Tokens appended one by one attend exactly as the same tokens appended at once
    (every token is quantized alone; the prefix boundary may fall inside a chunk)."""
    mx.random.seed(5)
    q, k, v = (mx.random.normal((1, h, 9, D)) for h in (HQ, HKV, HKV))
    whole = kv_store_factory(config)().attend(q, k, v, 0.125, None)
    store = kv_store_factory(config)()
    for lo, hi in ((0, 2), (2, 3), (3, 7), (7, 9)):
        part = store.attend(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], 0.125, None)
        np.testing.assert_allclose(np.array(part), np.array(whole[:, :, lo:hi]), atol=ATOL)


def test_bytes_per_token_matches_formula(config: KVCacheConfig) -> None:
    store = _row_store(config, 6, seed=0)
    pair = kv_bytes_per_element_pair(config, 4, D)  # float32 K/V on CPU
    assert store.bytes_per_token() == pytest.approx(pair * HKV * D)
    assert store.nbytes() >= 6 * store.bytes_per_token()


def test_prefix_keeps_first_tokens_exact() -> None:
    """With start >= the row's length everything is full precision: fp attention exactly."""
    mx.random.seed(8)
    q, k, v = (mx.random.normal((1, h, 6, D)) for h in (HQ, HKV, HKV))
    config = KVCacheConfig(kind="turboquant", key_bits=2, value_bits=2, start=6)
    got = kv_store_factory(config)().attend(q, k, v, 0.125, None)
    ref = FullPrecisionKV().attend(q, k, v, 0.125, None)
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-5)


def test_start_zero_builds_no_wrapper() -> None:
    store = kv_store_factory(KVCacheConfig(kind="affine", bits=4))()
    assert not isinstance(store, PrefixKV)
