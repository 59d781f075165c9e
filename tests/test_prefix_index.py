"""The prefix cache's index without a model: matching, snapshot policy, LRU, bytes."""

from __future__ import annotations

from deltaserve.engine.cache.budget import MemoryBudget, StateCosts
from deltaserve.engine.prefix_cache.index import PrefixIndex

BLOCK, TOKEN, SNAP = 4, 3, 100
KV = BLOCK * TOKEN


def _index(max_bytes: int = 10**6, budget: int = 10**6) -> PrefixIndex:
    return PrefixIndex(BLOCK, TOKEN, SNAP, max_bytes, MemoryBudget(budget, StateCosts(1, 1)))


def _fill(index: PrefixIndex, prompt: list[int], row: str = "r") -> None:
    """What the scheduler does for a prompt: match, then insert at each snapshot point."""
    for point in index.match(prompt).snapshot_at:
        index.insert(row, prompt, point)


def test_miss_snapshots_at_last_block_boundary_that_leaves_a_token() -> None:
    index = _index()
    assert index.match(list(range(9))).snapshot_at == (8,)  # 8 leaves token 8
    assert index.match(list(range(8))).snapshot_at == (4,)  # 8 would leave none
    assert index.match(list(range(4))).snapshot_at == ()


def test_resent_prompt_resumes_at_its_snapshot() -> None:
    index = _index()
    prompt = list(range(11))
    _fill(index, prompt)
    hit = index.match(prompt)
    assert hit.tokens == 8 and len(hit.chain) == 2 and hit.snapshot_at == ()
    # Its first 8 tokens alone: the snapshot at 8 would leave nothing to compute, and
    # the one at 4 does not exist yet, so this prompt takes it.
    short = index.match(prompt[:8])
    assert short.tokens == 0 and short.snapshot_at == (4,)


def test_branch_point_is_snapshotted_then_hit() -> None:
    """Two prompts share 2 blocks: the second snapshots where it branches, the third
    resumes there."""
    index = _index()
    shared = list(range(8))
    _fill(index, shared + [100] * 9)  # snapshot at 16 only
    second = index.match(shared + [200] * 9)
    assert second.tokens == 0 and second.snapshot_at == (8, 16)
    for point in second.snapshot_at:
        assert index.insert("b", shared + [200] * 9, point) is not None
    third = index.match(shared + [300] * 9)
    assert third.tokens == 8 and third.snapshot_at == (16,)


def test_insert_saves_only_missing_blocks_and_counts_bytes() -> None:
    index = _index()
    a = list(range(12)) + [1]
    save = index.insert("a", a, 12)
    assert save is not None and [(lo, hi) for _, lo, hi in save.blocks] == [(0, 4), (4, 8), (8, 12)]
    assert index.stats.nbytes == 3 * KV + SNAP == index.budget.reserved
    b = list(range(8)) + [9, 9, 9, 9, 9]
    save = index.insert("b", b, 12)
    assert save is not None and [lo for _, lo, _ in save.blocks] == [8]  # 0, 4 shared
    assert index.insert("c", a, 12) is None  # already there
    assert index.stats.nbytes == 4 * KV + 2 * SNAP == index.budget.reserved


def test_lru_eviction_under_the_cap_prunes_kv_nobody_needs() -> None:
    index = _index(max_bytes=2 * (2 * KV + SNAP))  # room for two 2-block entries
    prompts = [[p] * 9 for p in (1, 2, 3)]
    for p in prompts[:2]:
        _fill(index, p)
    index.match(prompts[0])  # touch the first: the second is now least recent
    _fill(index, prompts[2])
    assert index.match(prompts[0]).tokens == 8
    assert index.match(prompts[1]).tokens == 0
    assert index.match(prompts[2]).tokens == 8
    drop = index.take_drops()
    assert drop is not None and len(drop.snapshots) == 1 and len(drop.kv) == 2
    assert index.stats.nbytes == 2 * (2 * KV + SNAP) and index.stats.evictions == 1


def test_kv_of_a_shared_parent_stays_while_a_child_needs_it() -> None:
    index = _index()
    shared = list(range(4))
    index.insert("a", shared + [1] * 5, 8)
    index.insert("b", shared + [2] * 5, 8)
    assert index.match(shared + [1] * 5).tokens == 8
    assert index.evict_for(index.budget.total - index.budget.reserved + KV + SNAP)
    drop = index.take_drops()
    assert drop is not None and len(drop.kv) == 1  # the leaf only, not the shared block
    assert index.match(shared + [1] * 5).tokens + index.match(shared + [2] * 5).tokens == 8


def test_rows_evict_the_cache_but_never_more_than_it_holds() -> None:
    index = _index(budget=1000)
    _fill(index, [5] * 9)
    held = index.stats.nbytes
    assert not index.evict_for(1001)  # even an empty cache would not make room
    assert index.stats.nbytes == held
    assert index.evict_for(1000 - held + 1)
    assert index.stats.nbytes == 0 and index.budget.reserved == 0


def test_insert_without_room_adds_nothing() -> None:
    index = _index(max_bytes=KV + SNAP - 1)
    assert index.insert("a", [1] * 5, 4) is None
    assert index.stats.nbytes == 0 and index.match([1] * 5).tokens == 0


def test_reset_releases_every_byte() -> None:
    index = _index()
    _fill(index, list(range(20)))
    index.reset()
    assert index.budget.reserved == 0 and index.match(list(range(20))).tokens == 0


def test_tail_snapshot_off_a_block_boundary_is_resumed_when_it_fits() -> None:
    index = _index()
    history = list(range(10))  # 2 blocks + a 2-token tail
    save = index.insert("a", history + [50, 51], 10)
    assert save is not None and [(lo, hi) for _, lo, hi in save.blocks] == [(0, 4), (4, 8), (8, 10)]
    assert index.stats.nbytes == 10 * TOKEN + SNAP
    hit = index.match(history + [60, 61, 62])
    assert hit.tokens == 10 and len(hit.chain) == 3
    assert index.match(history).tokens == 0  # would leave no token to compute
    assert index.match(list(range(9)) + [99, 1, 2]).tokens == 0  # tail differs
    assert index.insert("b", history + [7], 10) is None  # already there


def test_evicting_a_tail_frees_its_tokens_only() -> None:
    index = _index()
    base = list(range(8))
    index.insert("a", base + [1], 8)
    index.insert("b", base + [5, 6, 7], 11)
    before = index.stats.nbytes
    assert index.evict_for(index.budget.total - index.budget.reserved + 1)
    drop = index.take_drops()
    assert drop is not None
    # LRU is the first snapshot (at 8): its node keeps its KV, the tail needs it.
    assert drop.kv == () and index.stats.nbytes == before - SNAP
    assert index.match(base + [5, 6, 7, 8]).tokens == 11


def test_hint_adds_a_point_and_min_tokens_drops_early_ones() -> None:
    index = _index()
    prompt = list(range(23))
    assert index.match(prompt, hint=18).snapshot_at == (18,)  # instead of 20
    assert index.match(prompt, hint=23).snapshot_at == ()  # no token would be left
    index.min_tokens = 19
    assert index.match(prompt, hint=18).snapshot_at == ()
