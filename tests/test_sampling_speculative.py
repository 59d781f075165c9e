"""The speculative acceptance rule (engine/sampling/speculative.py): greedy matching, and
that accepted-or-resampled tokens are distributed exactly as the target's, alone and as
the engine runs it for sampled rows (engine/speculative.py, with the sampler's warp)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from deltaserve.engine.sampling.sampler import SamplingRow
from deltaserve.engine.sampling.speculative import accept_greedy, accept_sampled, random_inputs
from deltaserve.engine.sampling.warp import Warp, warp_probs
from deltaserve.engine.speculative import VerifyStep, draft_chooser, verify_verdict
from deltaserve.engine.types import SamplingParams

V, K = 8, 2  # a small vocabulary, two drafts (three target positions)
ROWS = 100_000  # per seed; sampling noise of a TV estimate ~ sqrt(V / ROWS) / 2 ~ 0.005
TV_BOUND = 0.015


def _dist(key: mx.array, shape: tuple[int, ...], sharp: float) -> mx.array:
    return mx.softmax(sharp * mx.random.normal((*shape, V), key=key), axis=-1)


def _tv(tokens: mx.array, probs: mx.array) -> float:
    """Total variation between the empirical distribution of `tokens` and `probs` [V]."""
    counts = (tokens[:, None] == mx.arange(V)[None]).sum(axis=0).astype(mx.float32)
    return 0.5 * mx.abs(counts / max(tokens.shape[0], 1) - probs).sum().item()


def test_greedy_accepts_leading_matches() -> None:
    """Drafts count while they equal the argmax; the next token is the argmax after them."""
    best = mx.array([[3, 5, 7], [3, 5, 7], [3, 5, 7], [1, 1, 1]])
    logits = (best[..., None] == mx.arange(V)).astype(mx.float32)
    drafts = mx.array([[3, 5], [3, 4], [2, 5], [1, 1]])
    verdict = accept_greedy(logits, drafts)
    assert verdict.num_accepted.tolist() == [2, 1, 0, 2]
    assert verdict.next_token.tolist() == [7, 5, 3, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emitted_tokens_follow_target(seed: int) -> None:
    """With drafts drawn from q: the first emitted token ~ p_0; given draft 1 accepted, the
    second ~ p_1; given both accepted, the bonus ~ p_2 (total variation bounds)."""
    keys = mx.random.split(mx.random.key(seed), 5)
    p = mx.broadcast_to(_dist(keys[0], (1, K + 1), 1.5), (ROWS, K + 1, V))
    q = mx.broadcast_to(_dist(keys[1], (1, K), 1.5), (ROWS, K, V))
    drafts = mx.random.categorical(mx.log(q), key=keys[2]).astype(mx.int32)  # [ROWS, K]
    uniform, gumbel = random_inputs(ROWS, K, V, keys[3])
    verdict = accept_sampled(p, drafts, q, uniform, gumbel)
    count, nxt = verdict.num_accepted, verdict.next_token
    first = mx.where(count >= 1, drafts[:, 0], nxt)
    assert _tv(first, p[0, 0]) < TV_BOUND
    second = mx.where(count >= 2, drafts[:, 1], nxt)
    assert _tv(_select(second, count >= 1), p[0, 1]) < TV_BOUND
    assert _tv(_select(nxt, count == K), p[0, K]) < 2 * TV_BOUND  # fewer rows get here


def _select(x: mx.array, mask: mx.array) -> mx.array:
    idx = [i for i, m in enumerate(mask.tolist()) if m]
    return x[mx.array(idx)] if idx else x[:0]


def test_one_hot_distributions_reduce_to_greedy() -> None:
    """Greedy as one-hot p and q: the stochastic rule gives accept_greedy's verdict for
    any noise (so one code path can serve mixed batches)."""
    logits = mx.random.normal((64, K + 1, V), key=mx.random.key(7))
    drafts = mx.random.randint(0, V, (64, K), key=mx.random.key(8)).astype(mx.int32)
    drafts = mx.where(mx.random.uniform(shape=(64, K), key=mx.random.key(9)) < 0.5,
                      mx.argmax(logits[:, :K], axis=-1).astype(mx.int32), drafts)  # fmt: skip
    p = (mx.argmax(logits, axis=-1)[..., None] == mx.arange(V)).astype(mx.float32)
    q = (drafts[..., None] == mx.arange(V)).astype(mx.float32)
    uniform, gumbel = random_inputs(64, K, V, mx.random.key(10))
    got, want = accept_sampled(p, drafts, q, uniform, gumbel), accept_greedy(logits, drafts)
    assert got.num_accepted.tolist() == want.num_accepted.tolist()
    assert got.next_token.tolist() == want.next_token.tolist()


def test_draft_equal_to_target_is_always_accepted() -> None:
    """q == p: every draft is accepted (p/q = 1 > u) and the bonus comes from p_k."""
    p = _dist(mx.random.key(3), (16, K + 1), 1.0)
    drafts = mx.random.categorical(mx.log(p[:, :K]), key=mx.random.key(4)).astype(mx.int32)
    uniform, gumbel = random_inputs(16, K, V, mx.random.key(5))
    verdict = accept_sampled(p, drafts, p[:, :K], uniform, gumbel)
    assert verdict.num_accepted.tolist() == [K] * 16


@pytest.mark.parametrize("seeded", [False, True])
def test_engine_draft_and_accept_follow_the_warped_target(seeded: bool) -> None:
    """The engine's own path for a sampled row (engine/speculative.py: drafts drawn by
    draft_chooser from the head's logits under the row's warp, verdicts from
    verify_verdict) emits tokens distributed as the warped target, with a head whose
    distribution differs from the target's."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02, max_tokens=4)
    params = dataclasses.replace(params, seed=0) if seeded else params
    rows = ROWS // 2 if seeded else ROWS  # seeded keys are built on the host, row by row
    batch = [
        SamplingRow(dataclasses.replace(params, seed=i) if seeded else params, (1,), (2, 3))
        for i in range(rows)
    ]
    keys = mx.random.split(mx.random.key(11), 2)
    target = mx.broadcast_to(2.0 * mx.random.normal((1, K + 1, V), key=keys[0]), (rows, K + 1, V))
    head = mx.broadcast_to(2.0 * mx.random.normal((1, K, V), key=keys[1]), (rows, K, V))
    choose = draft_chooser(batch, K)
    drafts = mx.stack([choose(head[:, i]) for i in range(K)], axis=1)
    step = VerifyStep(tuple(map(str, range(rows))), drafts, head, target[..., :1], target, ())
    verdict = verify_verdict(step, batch)
    warp = Warp.of([params], V)
    p = [warp_probs(target[0, i : i + 1], warp)[0] for i in range(K + 1)]
    q = [warp_probs(head[0, i : i + 1], warp)[0] for i in range(K)]
    assert 0.5 * mx.abs(p[0] - q[0]).sum().item() > 0.1, "the draft must differ from p"
    count, nxt = verdict.num_accepted, verdict.next_token
    bound = TV_BOUND * (1.5 if seeded else 1.0)
    assert _tv(drafts[:, 0], q[0]) < bound  # the drafts come from q
    assert _tv(mx.where(count >= 1, drafts[:, 0], nxt), p[0]) < bound
    second = mx.where(count >= 2, drafts[:, 1], nxt)
    assert _tv(_select(second, count >= 1), p[1]) < 2 * bound
    assert len(set(count.tolist())) > 1  # rows accept different counts
