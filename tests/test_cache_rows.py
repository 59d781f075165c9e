"""Row ops of the batched stores (no model): merge / filter / extract keep every row equal
to the same row stored alone, and batched attention equals per-row attention."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import (
    FullPrecisionKV,
    KVStore,
    last_rows,
    round_capacity,
    take_rows,
)
from deltaserve.engine.cache.rows import RowStates
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.shapes import decode_bucket

HKV, HQ, D = 2, 4, 16


def _row_store(length: int, seed: int, factory=FullPrecisionKV) -> tuple[KVStore, mx.array]:
    """A B=1 store filled with `length` random tokens (in two appends when possible)."""
    mx.random.seed(seed)
    keys = mx.random.normal((1, HKV, length, D))
    values = mx.random.normal((1, HKV, length, D))
    store = factory()
    split = length // 2
    for lo, hi in ((0, split), (split, length)):
        if hi > lo:
            q = mx.random.normal((1, HQ, hi - lo, D))
            store.attend(q, keys[:, :, lo:hi], values[:, :, lo:hi], 0.25, None)
    return store, mx.concatenate([keys, values], axis=-1)


def _row_tokens(store: KVStore, row: int) -> np.ndarray:
    """The row's real stored tokens as [Hkv, T, 2D] (keys | values)."""
    pad = store.left_pad[row]
    keys, values = (a[row, :, pad : store.size] for a in store.arrays)
    return np.array(mx.concatenate([keys, values], axis=-1))


def _merged(lengths: list[int]) -> tuple[KVStore, list[mx.array]]:
    batch, originals = FullPrecisionKV(), []
    for i, n in enumerate(lengths):
        store, tokens = _row_store(n, seed=i)
        batch.merge(store)
        originals.append(tokens)
    return batch, originals


@pytest.mark.parametrize("lengths", [[5, 9, 1], [7], [3, 3], [12, 1, 6, 2]])
def test_merge_keeps_every_row(lengths: list[int]) -> None:
    """Merged rows are right-aligned, padded on the left, and hold exactly their tokens."""
    batch, originals = _merged(lengths)
    assert batch.size == max(lengths)
    assert batch.left_pad == [max(lengths) - n for n in lengths]
    for row, tokens in enumerate(originals):
        np.testing.assert_array_equal(_row_tokens(batch, row), np.array(tokens[0]))


def test_filter_trims_shared_padding_and_extract_copies() -> None:
    """Dropping the longest row trims the padding every survivor shared."""
    batch, originals = _merged([4, 10, 6])
    batch.filter([2, 0])
    assert batch.size == 6 and batch.left_pad == [0, 2]
    np.testing.assert_array_equal(_row_tokens(batch, 0), np.array(originals[2][0]))
    np.testing.assert_array_equal(_row_tokens(batch, 1), np.array(originals[0][0]))
    single = batch.extract(1)
    assert single.left_pad == [0] and single.size == 4
    np.testing.assert_array_equal(_row_tokens(single, 0), np.array(originals[0][0]))
    # An extracted row is independent: changing the batch afterwards leaves it alone.
    batch.filter([0])
    np.testing.assert_array_equal(_row_tokens(single, 0), np.array(originals[0][0]))


@pytest.mark.parametrize(
    "keep", [[0, 1, 2], [1, 2, 3, 4], [0, 1, 3, 4], [4, 3, 0], [2], [0, 2, 4], [3, 4, 0, 1], []]
)
def test_take_rows_equals_a_gather(keep: list[int]) -> None:
    """Rows in `keep`'s order, from slices of its consecutive runs (views or a concat)."""
    x = mx.random.normal((5, 2, 7, 3))[:, :, 2:6]  # column-sliced, as the KV filter's input
    np.testing.assert_array_equal(
        np.array(take_rows(x, keep)), np.array(x)[np.array(keep, dtype=np.int64)]
    )


def test_filter_keeps_unordered_survivors_of_several_runs() -> None:
    """Survivors in a new order, from several runs, hold exactly their own tokens."""
    batch, originals = _merged([3, 8, 5, 2, 6])
    batch.filter([4, 0, 2, 3])
    assert batch.size == 6 and batch.left_pad == [0, 3, 1, 4]
    for row, src in enumerate([4, 0, 2, 3]):
        np.testing.assert_array_equal(_row_tokens(batch, row), np.array(originals[src][0]))


def test_filter_to_nothing_and_merge_into_empty() -> None:
    batch, originals = _merged([3, 5])
    batch.filter([])
    assert batch.num_rows == 0 and batch.size == 0
    store, tokens = _row_store(2, seed=7)
    batch.merge(store)
    np.testing.assert_array_equal(_row_tokens(batch, 0), np.array(tokens[0]))


def _padded_row(length: int, pad: int, seed: int, capacity: int) -> tuple[KVStore, mx.array]:
    """A B=1 store of `length` tokens after `pad` columns of its own left padding, at
    `capacity` columns: what a compiled later chunk leaves (engine/decode.py)."""
    store, tokens = _row_store(length, seed)
    store.reserve(0, capacity)  # reallocated at the capacity bucket, as CompiledDecode.chunk
    store.arrays = [
        mx.concatenate([mx.zeros((*a.shape[:2], pad, a.shape[3]), a.dtype), a], axis=2)[
            :, :, :capacity
        ]
        for a in store.arrays
    ]
    store.left_pad, store.size = [pad], pad + length
    return store, tokens


def test_capacity_steps_grow_with_the_store() -> None:
    """A store's capacity (each one a compiled decode shape, traced on first use) steps by
    256 columns up to 2,048, then by an eighth of the power of two below: 40 capacities
    up to 32k columns instead of 128, never more than an eighth of the columns free, and
    always at least one; appends grow a store along those steps."""
    assert [round_capacity(c) for c in (0, 255, 256, 2047)] == [256, 256, 512, 2048]
    assert [round_capacity(c) for c in (2048, 4095, 4096, 8192, 32767)] == [
        2304, 4096, 4608, 9216, 32768,
    ]  # fmt: skip
    assert len({round_capacity(c) for c in range(32768)}) == 40
    for c in range(1, 70000, 7):
        cap = round_capacity(c)
        assert cap > c and cap % 256 == 0
        assert c < 2048 or cap - c <= c / 8
    store = FullPrecisionKV()
    seen = set()
    for _ in range(50):  # 50 chunks of 100 tokens
        store.store(mx.zeros((1, 2, 100, 8)), mx.zeros((1, 2, 100, 8)), None)
        seen.add(store.capacity)
    assert store.size == 5000 and store.capacity == round_capacity(4999) == 5120
    assert len(seen) == len({round_capacity(c - 1) for c in range(100, 5001, 100)})


def test_merge_drops_padding_every_row_of_a_side_shares() -> None:
    """Rows arriving with their own left padding (a compiled later chunk's) and at a
    capacity bucket join without either: into an empty store and into rows already there,
    the columns that are padding for every row of a side go, and the buffer is rebuilt at
    round_capacity. Each row still holds exactly its tokens."""
    batch = FullPrecisionKV()
    first, tokens_a = _padded_row(5, pad=11, seed=1, capacity=1024)
    batch.merge(first)
    assert batch.size == 5 and batch.left_pad == [0] and batch.capacity == 256
    second, tokens_b = _padded_row(9, pad=40, seed=2, capacity=2048)
    batch.merge(second)
    assert batch.size == 9 and batch.left_pad == [4, 0] and batch.capacity == 256
    np.testing.assert_array_equal(_row_tokens(batch, 0), np.array(tokens_a[0]))
    np.testing.assert_array_equal(_row_tokens(batch, 1), np.array(tokens_b[0]))
    plain, tokens_c = _row_store(3, seed=3)  # an unpadded row joins as before
    batch.merge(plain)
    assert batch.size == 9 and batch.left_pad == [4, 0, 6]
    np.testing.assert_array_equal(_row_tokens(batch, 2), np.array(tokens_c[0]))


def test_batched_attention_equals_each_row_alone() -> None:
    """One decode step over a left-padded batch equals the same step per row."""
    lengths = [3, 8, 1, 5]
    batch, _ = _merged(lengths)
    alone = [_row_store(n, seed=i)[0] for i, n in enumerate(lengths)]
    mx.random.seed(99)
    q = mx.random.normal((len(lengths), HQ, 1, D))
    k = mx.random.normal((len(lengths), HKV, 1, D))
    v = mx.random.normal((len(lengths), HKV, 1, D))
    out = batch.attend(q, k, v, 0.25, None)
    for row, store in enumerate(alone):
        ref = store.attend(q[row : row + 1], k[row : row + 1], v[row : row + 1], 0.25, None)
        np.testing.assert_allclose(np.array(out[row]), np.array(ref[0]), atol=1e-5)


def test_left_padded_prefill_matches_unpadded() -> None:
    """Rows prefilled together with left padding equal the rows prefilled alone."""
    mx.random.seed(3)
    lengths = [6, 2]
    q = mx.random.normal((2, HQ, 6, D))
    k = mx.random.normal((2, HKV, 6, D))
    v = mx.random.normal((2, HKV, 6, D))
    batch = FullPrecisionKV()
    out = batch.attend(q, k, v, 0.25, (0, 4))
    assert batch.left_pad == [0, 4]
    for row, n in enumerate(lengths):
        ref = FullPrecisionKV().attend(
            q[row : row + 1, :, 6 - n :],
            k[row : row + 1, :, 6 - n :],
            v[row : row + 1, :, 6 - n :],
            0.25,
            None,
        )
        np.testing.assert_allclose(np.array(out[row, :, 6 - n :]), np.array(ref[0]), atol=1e-5)


def test_ssm_row_ops_round_trip() -> None:
    """DeltaNet state rows survive merge, filter and extract bit for bit."""
    rows = []
    for i in range(3):
        mx.random.seed(i)
        s = SSMState()
        s.conv, s.ssm = mx.random.normal((1, 3, 8)), mx.random.normal((1, 2, 4, 4))
        rows.append(s)
    batch = SSMState()
    for s in rows:
        batch.merge(s)
    assert batch.num_rows == 3
    batch.filter([2, 0])
    for row, original in zip((0, 1), (rows[2], rows[0]), strict=True):
        single = batch.extract(row)
        np.testing.assert_array_equal(np.array(single.conv), np.array(original.conv))
        np.testing.assert_array_equal(np.array(single.ssm), np.array(original.ssm))
    # One run of survivors (a view of the old arrays), then a row joins after them
    batch.filter([1])
    batch.merge(rows[1])
    for row, original in zip((0, 1), (rows[0], rows[1]), strict=True):
        single = batch.extract(row)
        np.testing.assert_array_equal(np.array(single.ssm), np.array(original.ssm))


def test_decode_bucket_sizes() -> None:
    """Few distinct batch sizes (each a trace of the compiled step), capped by max rows."""
    sizes = {decode_bucket(n, 64) for n in range(1, 65)}
    assert sizes == {1, 2, 4, 8, 12, 16, 24, 32, 48, 64}
    assert all(decode_bucket(n, 64) >= n for n in range(1, 100))
    assert decode_bucket(50, 50) == 50 and decode_bucket(3, 2) == 3


def _three_prefilled_rows() -> RowStates:
    """RowStates (decode batch bucketed) with prefill states r0, r1, r2: KV rows of 3, 5
    and 7 tokens and DeltaNet states filled with 1, 2 and 3."""

    def fresh() -> BatchState:
        return BatchState([FullPrecisionKV(), SSMState()])

    states = RowStates(fresh, partial(decode_bucket, max_rows=16))
    for i, n in enumerate((3, 5, 7)):
        state = states.prefill_state(f"r{i}")
        store, _ = _row_store(n, seed=i)
        ssm = SSMState(1)
        ssm.conv, ssm.ssm = mx.full((1, 3, 4), float(i + 1)), mx.full((1, 2, 2, 2), float(i + 1))
        state.layers[:] = [store, ssm]
    return states


def test_bucketed_decode_batch_pads_with_dead_rows_and_drops_them() -> None:
    """RowStates holds the decode batch at its bucket size: dead rows (no tokens, zero
    state) after the live ones; a join or a leave drops them before re-padding, so live
    rows keep their order and contents."""
    states = _three_prefilled_rows()
    states.sync(["r0", "r1", "r2"], [], [])
    kv, ssm = states.decode.layers
    assert states.decode.num_rows == 4 and kv.lengths() == [3, 5, 7, 0]
    assert ssm.conv[:, 0, 0].tolist() == [1.0, 2.0, 3.0, 0.0]
    states.sync(["r0", "r2"], ["r1"], [])
    kv, ssm = states.decode.layers
    assert states.decode.num_rows == 2 and kv.lengths() == [3, 7]
    assert ssm.conv[:, 0, 0].tolist() == [1.0, 3.0]


def test_a_whole_batch_going_to_verify_and_back_trades_places() -> None:
    """Every decode row speculating (the verify batch empty) swaps the two batches, and
    so does their way back; a batch that keeps some rows moves only the others. Rows keep
    their contents and order (and the bucket's dead rows) either way."""
    states = _three_prefilled_rows()
    rows = ["r0", "r1", "r2"]
    states.sync(rows, [], [])
    decode = states.decode
    states.sync([], [], [], verify_row_ids=rows)
    assert states.verify is decode and states.verify_ids == rows and not states.decode_ids
    kv, ssm = states.verify.layers
    assert kv.lengths() == [3, 5, 7, 0] and ssm.conv[:, 0, 0].tolist() == [1.0, 2.0, 3.0, 0.0]
    states.sync(rows, [], [], verify_row_ids=[])
    assert states.decode is decode and states.decode_ids == rows and not states.verify_ids
    states.sync(["r0"], [], [], verify_row_ids=["r2", "r1"])  # some stay: rows move
    assert states.decode is decode and states.verify_ids == ["r2", "r1"]
    kv, ssm = states.verify.layers
    assert kv.lengths()[:2] == [7, 5] and ssm.conv[:2, 0, 0].tolist() == [3.0, 2.0]


def test_a_steps_mask_for_its_last_queries() -> None:
    """AttentionState.attend may get fewer queries than new tokens: an array mask keeps
    its last rows, "causal" stays (it aligns the last query with the last key) except for
    one query, which sees every key (None)."""
    mask = mx.arange(5)[:, None] >= mx.arange(9)[None, :]  # [5, 9]
    mask = mx.broadcast_to(mask[None, None], (2, 1, 5, 9))
    assert mx.array_equal(last_rows(mask, 2), mask[:, :, 3:]).item()
    assert last_rows(mask, 5) is mask
    assert last_rows("causal", 3) == "causal"
    assert last_rows("causal", 1) is None
    assert last_rows(None, 1) is None
