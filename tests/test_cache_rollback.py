"""Per-row rollback after a speculative verify (engine/cache: KVStore.rollback,
PrefixKV.rollback, SSMState.select_slots, BatchState.keep_verified).

Property: after a verify forward of `fed` tokens per row and keep_verified(kept), every
row's state equals that of a run that only ever fed its kept tokens: KV (valid region)
and DeltaNet state, for plain and quantized KV, dense and MoE; and the next greedy token
matches. Row ops stay exact: a rolled-back row's kept columns are its old columns, moved.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import pytest
from parity_utils import long_ids
from spec_utils import prefill, run

from deltaserve.engine.cache.kv import FullPrecisionKV, KVStore
from deltaserve.engine.cache.quantized import AffineKV, TurboQuantKV
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.cache.start_precision import PrefixKV
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.testing import cached_checkpoint

REL_TOL = 5e-5  # float32 math in another order (tests/test_model_incremental.py)
KINDS: dict[str, Callable[[], KVStore | PrefixKV]] = {
    "full": FullPrecisionKV,
    "affine8": lambda: AffineKV(8),
    "turboquant": TurboQuantKV,
    "prefix21-affine4": lambda: PrefixKV(21, AffineKV(4)),
}


def _rel(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-6)).item()


def _tokens(store: KVStore | PrefixKV, row: int) -> list[mx.array]:
    """Row `row`'s stored real columns, prefix part first (encoded as stored)."""
    out = store.extract(row)
    arrays = [a[:, :, : out.size] for a in out.arrays] if not isinstance(out, PrefixKV) else []
    if isinstance(out, PrefixKV):
        inner = out.inner
        inner_cols = [a[:, :, : inner.size] for a in inner.arrays] if inner.arrays else []
        prefix = [a[:, :, : out.plen[0]] for a in out.prefix]
        arrays = prefix + inner_cols
    return arrays


# --------------------------------------------------------------------------- no model


def _filled_store(kind: str, lengths: list[int], seed: int = 0) -> KVStore | PrefixKV:
    """A store whose rows hold `lengths` random tokens, left-padded (2 KV heads, D 64)."""
    store = KINDS[kind]()
    width = max(lengths)
    keys = mx.random.normal((len(lengths), 2, width, 64), key=mx.random.key(seed))
    values = mx.random.normal((len(lengths), 2, width, 64), key=mx.random.key(seed + 1))
    pads = tuple(width - n for n in lengths)
    store.attend(mx.zeros((len(lengths), 4, width, 64)), keys, values, 0.125, pads)
    return store


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("drop", [[0, 0, 0], [2, 2, 2], [0, 3, 1], [3, 0, 2]])
def test_rollback_keeps_each_rows_first_columns(kind: str, drop: list[int]) -> None:
    """Each row keeps exactly its first length - drop[b] columns, bit for bit, whatever
    the others drop; lengths shrink by drop."""
    lengths = [26, 9, 23]
    store = _filled_store(kind, lengths)
    before = [_tokens(store, b) for b in range(3)]
    store.rollback(drop)
    assert store.lengths() == [n - d for n, d in zip(lengths, drop, strict=True)]
    for b in range(3):
        after = _tokens(store, b)
        keep = lengths[b] - drop[b]
        want = _cut(before[b], keep, store, b)
        for got, ref in zip(after, want, strict=True):
            assert mx.array_equal(got, ref).item(), (kind, b)


def _cut(arrays: list[mx.array], keep: int, store: KVStore | PrefixKV, row: int) -> list[mx.array]:
    """The first `keep` tokens of a row's `_tokens` listing (prefix part, then inner)."""
    if not isinstance(store, PrefixKV):
        return [a[:, :, :keep] for a in arrays]
    in_prefix = min(keep, store.start)
    prefix, inner = arrays[:2], arrays[2:]
    return [a[:, :, :in_prefix] for a in prefix] + [a[:, :, : keep - in_prefix] for a in inner]


def test_rollback_then_append_attends_like_never_fed() -> None:
    """After a rollback the next append lands right after each row's kept tokens: the
    attention output equals a store that was fed only the kept tokens."""
    lengths, drop = [12, 7], [1, 3]
    keys = mx.random.normal((2, 2, 12, 64), key=mx.random.key(3))
    values = mx.random.normal((2, 2, 12, 64), key=mx.random.key(4))
    store = FullPrecisionKV()
    store.attend(mx.zeros((2, 4, 12, 64)), keys, values, 0.125, (0, 5))
    store.rollback(drop)
    q = mx.random.normal((2, 4, 1, 64), key=mx.random.key(5))
    new_k = mx.random.normal((2, 2, 1, 64), key=mx.random.key(6))
    got = store.attend(q, new_k, new_k, 0.125, None)
    for b in range(2):
        ref = FullPrecisionKV()
        kept = lengths[b] - drop[b]
        start = 12 - lengths[b]
        ref.attend(
            mx.zeros((1, 4, kept, 64)), keys[b : b + 1, :, start : start + kept],
            values[b : b + 1, :, start : start + kept], 0.125, None,
        )  # fmt: skip
        want = ref.attend(q[b : b + 1], new_k[b : b + 1], new_k[b : b + 1], 0.125, None)
        assert _rel(got[b : b + 1], want) < 1e-5


def test_select_slots_picks_each_rows_slot() -> None:
    """SSMState.select_slots: row b's conv and state become slot[b]'s; slots are cleared."""
    state = SSMState(2)
    conv = mx.random.normal((2, 4, 3, 8), key=mx.random.key(0))
    ssm = mx.random.normal((2, 4, 2, 5, 5), key=mx.random.key(1))
    state.slots = (conv, ssm)
    state.select_slots([3, 1])
    assert mx.array_equal(state.conv[0], conv[0, 3]).item()
    assert mx.array_equal(state.ssm[1], ssm[1, 1]).item()
    assert state.slots is None


def test_rollback_rejects_more_than_a_row_holds() -> None:
    store = _filled_store("full", [4, 2])
    with pytest.raises(AssertionError):
        store.rollback([0, 3])


# --------------------------------------------------------------------------- the model


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


PROMPT_LENGTHS = (30, 19)
CHUNKS = ([501, 502, 503, 504], [601, 602, 603, 604])  # each row's last token + 3 drafts


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("kept", [[2, 4], [1, 3], [4, 1]])
def test_verify_then_rollback_equals_kept_only_run(
    loaded: LoadedModel, kind: str, kept: list[int]
) -> None:
    """Verify 4 tokens per row in one batch, keep kept[b]: each layer's state equals a run
    of that row alone that fed only its kept tokens, and the next token's logits match."""
    prompts = [long_ids(n) for n in PROMPT_LENGTHS]
    state, _ = prefill(loaded, prompts, KINDS[kind])
    run(loaded, state, CHUNKS, list(PROMPT_LENGTHS), state_slots=True)
    state.keep_verified(kept, fed=4)
    nxt = [[700], [800]]
    offsets = [n + k for n, k in zip(PROMPT_LENGTHS, kept, strict=True)]
    refs = []
    for b in range(2):
        ref, _ = prefill(loaded, [prompts[b]], KINDS[kind])
        run(loaded, ref, [CHUNKS[b][: kept[b]]], [PROMPT_LENGTHS[b]])
        refs.append(ref)
        for got, want in zip(state.layers, ref.layers, strict=True):
            if isinstance(got, SSMState):
                assert _rel(got.conv[b], want.conv[0]) < REL_TOL
                assert _rel(got.ssm[b], want.ssm[0]) < REL_TOL
            else:
                assert got.lengths()[b] == want.lengths()[0]
                if kind == "full":
                    for x, y in zip(_tokens(got, b), _tokens(want, 0), strict=True):
                        assert _rel(x, y) < REL_TOL
    batch_logits = loaded.model.logits(run(loaded, state, nxt, offsets))
    for b, ref in enumerate(refs):
        want = loaded.model.logits(run(loaded, ref, [nxt[b]], [offsets[b]]))[0, -1]
        got = batch_logits[b, -1]
        assert _rel(got, want) < (REL_TOL if kind == "full" else 1e-3)
        assert mx.argmax(got).item() == mx.argmax(want).item()


@pytest.mark.parametrize("kind", list(KINDS))
def test_step_padding_after_real_tokens(kind: str) -> None:
    """A step that pads a row already holding tokens (the MTP head's uneven chunks): the
    row's tokens move over the padding, and its stored tokens are its old ones followed by
    its real new ones, exactly as stored."""
    store = _filled_store(kind, [10, 6])
    before = [_tokens(store, b) for b in range(2)]
    keys = mx.random.normal((2, 2, 3, 64), key=mx.random.key(11))
    store.attend(mx.zeros((2, 4, 3, 64)), keys, keys, 0.125, (0, 2))
    assert store.lengths() == [13, 7]
    ref = KINDS[kind]()
    ref.attend(mx.zeros((1, 4, 1, 64)), keys[1:, :, 2:], keys[1:, :, 2:], 0.125, None)
    new = _tokens(ref, 0)
    for got, old, added in zip(_tokens(store, 1), before[1], new, strict=False):
        assert mx.array_equal(got, mx.concatenate([old, added], axis=2)).item(), kind
