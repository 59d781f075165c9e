"""The prefix cache inside the real engine: a hit changes no token, and memory adds up.

Greedy outputs with the cache on (cold, then hitting) equal those of an engine without
it, for dense and MoE checkpoints and every KV kind, for prompts that share a prefix
ending at, before and after a block boundary. The peaked tiny checkpoints make
token-exact comparisons meaningful (tests/test_engine_batching.py).
"""

from __future__ import annotations

import random

import pytest

from deltaserve.engine.config import EngineConfig, KVCacheConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.testing import cached_checkpoint

BLOCK = 16
KINDS = {
    "fp": KVCacheConfig(),
    "affine4": KVCacheConfig(kind="affine", bits=4),
    "affine8": KVCacheConfig(kind="affine", bits=8),
    "tq_k8v3": KVCacheConfig(kind="turboquant", key_bits=8, value_bits=3),
}


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


def _config(cache: bool, kv: KVCacheConfig = KINDS["fp"], **kw) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=16,
        max_num_batched_tokens=48,
        max_prefill_chunk=24,
        prefix_cache=cache,
        prefix_block_tokens=BLOCK,
        prefix_min_tokens=1,
        kv_cache=kv,
        **kw,
    )


def _greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 240000) for _ in range(n)]


def _sharing_prompts(seed: int = 0) -> list[list[int]]:
    """A base prompt, itself again, then prompts leaving it at, before and after a block
    boundary (and one a block longer)."""
    rng = random.Random(seed)
    base = _tokens(rng, 4 * BLOCK + 5)
    shared = [2 * BLOCK, 2 * BLOCK - 1, 2 * BLOCK + 1, 3 * BLOCK]
    return [base, base] + [base[:n] + _tokens(rng, 20) for n in shared] + [base + base[:BLOCK]]


def _cached(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """Run one request alone; its tokens and the cached-token count it reported."""
    engine.add_request(GenerationRequest("one", tuple(prompt), _greedy()))
    tokens, cached = [], -1
    while engine.has_work():
        for delta in engine.step():
            tokens += delta.token_ids
            cached = delta.num_cached_tokens
    return tokens, cached


# MoE with the fp kind only: the KV kinds store attention K/V and do not depend on the
# MLP, which is all that MoE changes (and each engine run of tiny-moe costs seconds).
@pytest.mark.parametrize(
    "loaded, kind",
    [("tiny", kind) for kind in KINDS] + [("tiny-moe", "fp")],
    indirect=["loaded"],
)
def test_hits_are_token_exact(loaded: LoadedModel, kind: str) -> None:
    prompts = _sharing_prompts()
    expected = LLMEngine(loaded, _config(False, KINDS[kind])).generate(prompts, _greedy())
    engine = LLMEngine(loaded, _config(True, KINDS[kind]))
    results = [_cached(engine, p) for p in prompts]
    for prompt, want, (got, _) in zip(prompts, expected, results, strict=True):
        assert got == want.token_ids, f"prompt of {len(prompt)} tokens"
    cached = [c for _, c in results]
    # cold; resent (last boundary); at 32 the first prompt left no snapshot, so these
    # take one at their branch point (32) and the next hits it; a block longer: resumes
    # at the base prompt's last boundary.
    assert cached == [0, 4 * BLOCK, 0, 0, 2 * BLOCK, 2 * BLOCK, 4 * BLOCK]
    assert engine.states.prefix.nbytes() == engine.prefix_cache.stats.nbytes


@pytest.mark.parametrize("inside", [True, False])
def test_chat_turn_snapshot_inside_a_chunk(loaded: LoadedModel, inside: bool) -> None:
    """A chat's first turn snapshots at its history end (prefix_hint 45), inside its
    second 24-token chunk (snapshot_in_chunk: the chunk is not cut there) or as a chunk's
    end; the second turn resumes at 45 either way, both turns equal to no cache."""
    rng = random.Random(4)
    first = _tokens(rng, 61)
    second = first[:45] + _tokens(rng, 19)
    want = LLMEngine(loaded, _config(False)).generate([first, second], _greedy())
    # an eager prefill core keeps a snapshot inside its chunk; a compiled one ends it there
    engine = LLMEngine(loaded, _config(True, compile_prefill=not inside))
    execute, chunks = engine.runner.execute, []

    def recording(plan):  # noqa: ANN001, ANN202
        chunks.extend((c.start, c.length, c.snapshot_at) for c in plan.prefill)
        return execute(plan)

    engine.runner.execute = recording
    engine.add_request(GenerationRequest("t1", tuple(first), _greedy(), prefix_hint=45))
    got = []
    while engine.has_work():
        got += [t for d in engine.step() for t in d.token_ids]
    assert got == want[0].token_ids
    split = [(0, 24, 0), (24, 24, 21), (48, 13, 0)] if inside else [(0, 24, 0), (24, 21, 0)]
    assert chunks[: len(split)] == split
    assert _cached(engine, second) == (want[1].token_ids, 45)


def test_forks_of_a_hit_equal_the_uncached_forks(loaded: LoadedModel) -> None:
    rng = random.Random(1)
    prompt = _tokens(rng, 3 * BLOCK + 3)
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=11, ignore_eos=True)
    engines = [LLMEngine(loaded, _config(c)) for c in (False, True, True)]
    outputs = []
    for engine in engines[:2]:
        engine.add_request(GenerationRequest("warm", tuple(prompt), _greedy()))
        while engine.has_work():
            engine.step()
    for engine in engines:
        engine.add_request(GenerationRequest("n3", tuple(prompt), params, n=3))
        tokens: dict[int, list[int]] = {}
        while engine.has_work():
            for delta in engine.step():
                tokens.setdefault(delta.index, []).extend(delta.token_ids)
        outputs.append(tokens)
    assert engines[1].prefix_cache.stats.hit_tokens == 3 * BLOCK
    assert outputs[0] == outputs[1] == outputs[2]


def test_concurrent_sharing_while_evicting_and_memory_adds_up(loaded: LoadedModel) -> None:
    """40 requests over 3 shared prefixes arrive in waves while a small cache evicts;
    every output equals the uncached engine's, and after every step the cache's arrays
    are exactly what its index reserved, within the budget."""
    rng = random.Random(2)
    heads = [_tokens(rng, rng.choice([BLOCK, 2 * BLOCK + 3, 3 * BLOCK])) for _ in range(3)]
    prompts = [rng.choice(heads) + _tokens(rng, rng.randrange(1, 30)) for _ in range(40)]
    waves = {10 * w: prompts[8 * w : 8 * w + 8] for w in range(5)}
    expected = _drive(LLMEngine(loaded, _config(False)), waves)
    probe = LLMEngine(loaded, _config(True))
    snapshot = probe.prefix_cache.snapshot_bytes + BLOCK * probe.budget.costs.kv_bytes_per_token
    engine = LLMEngine(loaded, _config(True, prefix_cache_bytes=4 * snapshot))
    got = _drive(engine, waves, check=True)
    assert got == expected
    stats = engine.prefix_cache.stats
    assert stats.hit_tokens > 0 and stats.evictions > 0


def _drive(
    engine: LLMEngine, waves: dict[int, list[list[int]]], check: bool = False
) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in waves):
        for i, prompt in enumerate(waves.get(step, [])):
            engine.add_request(GenerationRequest(f"{step}-{i}", tuple(prompt), _greedy(6)))
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        if check:
            index = engine.prefix_cache
            assert engine.states.prefix.nbytes() == index.stats.nbytes
            assert engine.budget.reserved <= engine.budget.total
        step += 1
    return tokens


def test_no_prefix_cache_config_builds_none(loaded: LoadedModel) -> None:
    engine = LLMEngine(loaded, _config(False))
    assert engine.prefix_cache is None and engine.states.prefix is None
    start16 = KVCacheConfig(kind="affine", bits=8, start=16)
    assert LLMEngine(loaded, _config(True, start16)).prefix_cache is None


def test_budget_holds_real_bytes_with_one_long_row_and_many_short(loaded: LoadedModel) -> None:
    """The decode batch is left-padded to its longest row: admission must count that
    (engine/cache/budget.py), so the bytes the states really hold stay in the budget.
    Every request finishes, the short ones wait while the long one pins the width."""
    probe = LLMEngine(loaded, _config(False))
    costs = probe.budget.costs
    rng = random.Random(3)
    long_prompt, shorts = _tokens(rng, 300), [_tokens(rng, 10) for _ in range(12)]
    # Room for the long row and ~12 short rows by their own lengths, ~3 when padded.
    row = probe.budget.row_bytes
    budget = row(306) + 12 * row(16)
    engine = LLMEngine(loaded, _config(False, memory_budget_bytes=budget))
    waves = {0: [long_prompt], 4: shorts}
    peak_rows = 0
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or step <= 4:
        for i, prompt in enumerate(waves.get(step, [])):
            engine.add_request(GenerationRequest(f"{step}-{i}", tuple(prompt), _greedy(6)))
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        assert engine.states.nbytes() <= engine.budget.total
        peak_rows = max(peak_rows, engine.scheduler.num_running)
        step += 1
    assert len(tokens) == 13 and all(len(t) == 6 for t in tokens.values())
    assert 1 < peak_rows < 13 and costs.kv_bytes_per_token > 0
