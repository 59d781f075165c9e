"""Tests of the vectorized sampler against naive per-row numpy references."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.engine.sampling.noise import gumbel_noise, row_key, splitmix64
from deltaserve.engine.sampling.sampler import Sampler, SamplingRow
from deltaserve.engine.types import SamplingParams


def make_row(
    prompt: Sequence[int] = (1, 2, 3), out: Sequence[int] = (), choice: int = 0, **kw: object
) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), tuple(prompt), tuple(out), choice)  # type: ignore[arg-type]


def rand_logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, vocab)) * scale).astype(np.float32)


def naive_process(logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
    """Bias -> repetition (HF, prompt + output) -> presence/frequency (output), row by row."""
    z = logits.astype(np.float64).copy()
    for i, r in enumerate(rows):
        p = r.params
        for t, b in p.logit_bias.items():
            if t < z.shape[1]:  # ids outside the vocabulary are ignored
                z[i, t] += b
        for t in set(r.prompt_ids) | set(r.output_ids):
            if p.repetition_penalty != 1.0:
                pen = p.repetition_penalty
                z[i, t] = z[i, t] / pen if z[i, t] > 0 else z[i, t] * pen
        for t, c in Counter(r.output_ids).items():
            z[i, t] -= p.presence_penalty + p.frequency_penalty * c
    return z


def naive_probs(z: np.ndarray, p: SamplingParams) -> np.ndarray:
    """HF-order warpers on one row: temperature, top_k, top_p (renormalised), min_p."""
    y = z.astype(np.float64) / p.temperature
    probs = np.exp(y - y.max())
    probs /= probs.sum()
    order = np.argsort(-y, kind="stable")
    keep = np.ones(len(y), dtype=bool)
    if p.top_k:
        keep[order[p.top_k :]] = False
    if p.top_p < 1.0:
        q = (probs * keep)[order]
        q /= q.sum()
        keep[order[(np.cumsum(q) - q) >= p.top_p]] = False
    if p.min_p:
        keep &= probs >= p.min_p * probs.max()
    out = probs * keep
    return out / out.sum()


def chi2_ok(tokens: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson chi-square within a p ~ 3e-5 bound (Wilson-Hilferty) and no draw off-support."""
    counts = np.bincount(tokens, minlength=len(probs))
    if counts[probs == 0].sum():
        return False
    expected = probs[probs > 0] * len(tokens)
    stat = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    df = max(int((probs > 0).sum()) - 1, 1)
    crit = df * (1 - 2 / (9 * df) + 4.0 * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


def draw_many(logits_row: np.ndarray, n: int, seeded: bool = True, **kw: object) -> np.ndarray:
    rows = [make_row(seed=i if seeded else None, **kw) for i in range(n)]
    logits = mx.broadcast_to(mx.array(logits_row)[None], (n, len(logits_row)))
    return np.array(Sampler().sample(logits, rows).tokens)


def test_greedy_is_argmax_fast_path() -> None:
    logits = rand_logits(8, 1000)
    rows = [make_row(temperature=0.0) if i % 2 else make_row(top_k=1) for i in range(8)]
    batch = Sampler().sample(mx.array(logits), rows)
    assert batch.logprobs is None and batch.tokens.dtype == mx.int32
    assert np.array(batch.tokens).tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_in_mixed_batch_take_argmax_of_processed_logits() -> None:
    logits = rand_logits(6, 300, seed=1)
    rows = [
        make_row(temperature=0.0, repetition_penalty=2.0, out=(5, 6), prompt=tuple(range(40))),
        make_row(temperature=0.7, seed=3),
        make_row(top_k=1, presence_penalty=2.0, frequency_penalty=1.0, out=(9, 9, 9)),
        make_row(temperature=1.3, top_p=0.5, seed=4),
        make_row(temperature=0.0, logit_bias={17: 30.0}),
        make_row(temperature=0.0),
    ]
    tokens = np.array(Sampler().sample(mx.array(logits), rows).tokens)
    expected = naive_process(logits, rows).argmax(-1)
    for i in (0, 2, 4, 5):
        assert tokens[i] == expected[i]


def mixed_rows(step: int) -> list[SamplingRow]:
    out = tuple((7 * step + j) % 50 for j in range(step))
    kws: list[dict] = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.6, "top_p": 0.9},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.8},
        {"top_k": 5},
        {"top_k": 50, "min_p": 0.05},
        {"temperature": 1.5, "min_p": 0.1, "top_p": 0.95},
        {"repetition_penalty": 1.3, "top_p": 0.7},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5, "temperature": 0.9},
        {"logit_bias": {3: 5.0, 4: -100.0}, "top_k": 3},
        {"temperature": 0.0, "repetition_penalty": 1.2, "logprobs": True, "top_logprobs": 4},
        {"logprobs": True, "top_logprobs": 2, "top_p": 0.5},
        {"logprobs": True, "temperature": 2.0},
        {"top_k": 1, "temperature": 0.9},
        {"temperature": 0.3, "top_k": 400},
        {"min_p": 0.5, "logprobs": True, "top_logprobs": 20},
    ]
    return [make_row(prompt=(i, 2 * i), out=out, seed=100 + i, **kw) for i, kw in enumerate(kws)]


@pytest.mark.parametrize("step", [0, 3])
def test_mixed_batch_equals_each_row_alone(step: int) -> None:
    rows = mixed_rows(step)
    logits = mx.array(rand_logits(len(rows), 500, seed=step, scale=2.0))
    sampler = Sampler()
    batch = sampler.sample(logits, rows)
    tokens, lps = batch.to_python(rows)
    for i, r in enumerate(rows):
        alone_tokens, alone_lps = sampler.sample(logits[i : i + 1], [r]).to_python([r])
        assert alone_tokens[0] == tokens[i], f"row {i}"
        assert (alone_lps[0] is None) == (lps[i] is None) == (not r.params.logprobs)
        if lps[i] is not None and alone_lps[0] is not None:
            assert [t for t, _ in alone_lps[0].top] == [t for t, _ in lps[i].top]
            assert alone_lps[0].logprob == pytest.approx(lps[i].logprob, abs=1e-5)
    perm = np.random.default_rng(step).permutation(len(rows)).tolist()
    shuffled = sampler.sample(logits[mx.array(perm)], [rows[j] for j in perm]).tokens.tolist()
    assert shuffled == [tokens[j] for j in perm]
    half = perm[:7]
    sub = sampler.sample(logits[mx.array(half)], [rows[j] for j in half]).tokens.tolist()
    assert sub == [tokens[j] for j in half]


def test_seeded_rows_reproducible_across_compositions() -> None:
    vocab = 1000
    flat = rand_logits(1, vocab, seed=5, scale=0.1)[0]  # near-uniform: draws vary a lot
    target = make_row(seed=1234, temperature=1.0, out=(1, 2))
    results = set()
    for n, pos in [(1, 0), (4, 3), (16, 7), (9, 0)]:
        rows = [make_row(temperature=0.9, top_p=0.9) for _ in range(n)]  # unseeded neighbours
        rows[pos] = target
        logits = np.tile(flat, (n, 1)) + rand_logits(n, vocab, seed=n)
        logits[pos] = flat
        results.add(Sampler().sample(mx.array(logits), rows).tokens.tolist()[pos])
    assert len(results) == 1
    # Step, seed and choice each change the stream.
    base = mx.array(flat[None])
    draws = [
        Sampler().sample(base, [make_row(seed=s, out=(0,) * t, choice=c)]).tokens.item()
        for s, t, c in [(1234, 2, 0), (1234, 3, 0), (1235, 2, 0), (1234, 2, 1), (9, 0, 0)]
    ]
    assert len(set(draws)) >= 4


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = rand_logits(64, 200, seed=2, scale=1.0)
    expected = logits.argmax(-1).tolist()
    s = Sampler()
    rows_k = [make_row(top_k=1, temperature=1.5, seed=i) for i in range(64)]
    rows_p = [make_row(top_p=1e-6, temperature=1.5, seed=i) for i in range(64)]
    rows_mix = [make_row(top_p=1e-6, top_k=10, temperature=2.0) for _ in range(64)]
    for rows in (rows_k, rows_p, rows_mix):
        assert s.sample(mx.array(logits), rows).tokens.tolist() == expected


def test_penalties_match_naive_reference() -> None:
    logits = rand_logits(5, 64, seed=3)
    rows = [
        make_row(prompt=(1, 2, 2, 3, 40), out=(3, 3, 5, 40, 41), repetition_penalty=1.7),
        make_row(prompt=(1,), out=(7, 7, 7, 8, 1), presence_penalty=0.5, frequency_penalty=0.3),
        make_row(prompt=(6, 9), out=(9, 10), repetition_penalty=0.5, presence_penalty=-1.0),
        make_row(out=(3, 4), logit_bias={0: 2.5, 63: -7.0, 10**6: 1.0}, frequency_penalty=-2.0),
        make_row(out=(3, 4)),
    ]
    got = np.array(Sampler().process(mx.array(logits), rows))
    np.testing.assert_allclose(got, naive_process(logits, rows), rtol=1e-6, atol=1e-5)
    assert (got[4] == logits[4]).all()


def test_logit_bias_bans_and_forces() -> None:
    logits = rand_logits(1, 50, seed=4)[0]
    best = int(logits.argmax())
    banned = draw_many(logits, 500, logit_bias={best: -100.0}, temperature=1.0)
    assert best not in banned.tolist()
    forced = draw_many(logits, 500, logit_bias={11: 100.0}, temperature=1.0)
    assert set(forced.tolist()) == {11}


def test_logprobs_match_log_softmax_of_processed_logits() -> None:
    logits = rand_logits(4, 300, seed=6)
    rows = [
        make_row(logprobs=True, top_logprobs=5, temperature=0.5, seed=1),
        make_row(temperature=0.7, seed=2),
        make_row(logprobs=True, repetition_penalty=1.5, out=(4, 5), temperature=0.0),
        make_row(logprobs=True, top_logprobs=0, top_k=4, seed=3),
    ]
    tokens, lps = Sampler().sample(mx.array(logits), rows).to_python(rows)
    z = naive_process(logits, rows)
    ref = (
        z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1)[:, None]
    )
    assert lps[1] is None
    for i in (0, 2, 3):
        lp = lps[i]
        assert lp is not None and lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(ref[i, tokens[i]], abs=1e-4)
        k = rows[i].params.top_logprobs
        assert [t for t, _ in lp.top] == np.argsort(-ref[i])[:k].tolist()
        assert [v for _, v in lp.top] == pytest.approx(np.sort(ref[i])[::-1][:k], abs=1e-4)


def test_gumbel_noise_matches_numpy_hash() -> None:
    keys = [row_key(7, 0, 3), row_key(8, 1, 0)]
    k = np.array(keys, dtype=np.uint64).view(np.uint32).reshape(2, 2)
    ids = np.arange(1000, dtype=np.uint32)

    def fmix(h: np.ndarray) -> np.ndarray:
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> np.uint32(16))

    h = fmix(fmix(ids[None] ^ k[:, :1]) ^ k[:, 1:])
    u = ((h >> np.uint32(9)).astype(np.float64) + 0.5) / (1 << 23)
    got = gumbel_noise(mx.array(k[:, :1]), mx.array(k[:, 1:]), mx.array(ids))
    np.testing.assert_allclose(np.array(got), -np.log(-np.log(u)), rtol=1e-5, atol=1e-5)
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # reference SplitMix64 output for state 0


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.8},
        {"top_k": 7, "top_p": 0.9, "min_p": 0.01},
        {"top_p": 0.8, "temperature": 1.3},
        {"min_p": 0.05},
    ],
)
def test_seeded_draw_is_argmax_of_logits_plus_hashed_gumbel(kw: dict) -> None:
    """The reproducibility contract: token = argmax over the kept set of y + g(key, id)."""
    vocab = 400
    logits = rand_logits(6, vocab, seed=10, scale=1.0)
    rows = [make_row(seed=50 + i, out=(1,) * i, choice=i % 2, **kw) for i in range(6)]
    tokens = Sampler().sample(mx.array(logits), rows).tokens.tolist()
    keys = np.array([row_key(50 + i, i % 2, i) for i in range(6)], np.uint64).view(np.uint32)
    keys = mx.array(keys.reshape(6, 2))
    ids = mx.arange(vocab, dtype=mx.uint32)
    noise = np.array(gumbel_noise(keys[:, :1], keys[:, 1:], ids))
    for i, r in enumerate(rows):
        kept = naive_probs(logits[i], r.params) > 0
        scores = np.where(kept, logits[i] / r.params.temperature + noise[i], -np.inf)
        assert tokens[i] == int(scores.argmax())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("seeded", [True, False])
def test_distribution_matches_softmax(temperature: float, seeded: bool) -> None:
    mx.random.seed(11)
    logits = rand_logits(1, 8, seed=7, scale=1.0)[0]
    tokens = draw_many(logits, 30000, seeded=seeded, temperature=temperature)
    assert chi2_ok(tokens, naive_probs(logits, SamplingParams(temperature=temperature)))


@pytest.mark.parametrize(
    "kw",
    [
        {"top_k": 3},
        {"top_p": 0.6},
        {"top_k": 5, "top_p": 0.7, "temperature": 0.8},
        {"min_p": 0.2, "temperature": 1.5},
        {"top_p": 0.9, "min_p": 0.3},
    ],
)
def test_truncated_distributions(kw: dict) -> None:
    logits = rand_logits(1, 12, seed=8, scale=1.5)[0]
    probs = naive_probs(logits, SamplingParams(**kw))
    assert 1 < (probs > 0).sum() < 12
    assert chi2_ok(draw_many(logits, 20000, **kw), probs)


def test_full_vocab_rows_keep_within_their_nucleus() -> None:
    vocab = 248320
    logits = rand_logits(3, vocab, seed=9, scale=4.0)
    rows = [
        make_row(top_p=0.9, temperature=0.7, seed=1),
        make_row(top_k=20, top_p=0.8, seed=2),
        make_row(min_p=0.1, seed=3, logprobs=True, top_logprobs=3),
    ]
    s = Sampler()
    tokens = s.sample(mx.array(logits), rows).tokens.tolist()
    for i, r in enumerate(rows):
        assert naive_probs(logits[i], r.params)[tokens[i]] > 0
        assert s.sample(mx.array(logits[i : i + 1]), [r]).tokens.item() == tokens[i]
