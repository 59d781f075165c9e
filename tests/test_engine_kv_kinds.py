"""Quantized KV kinds inside the real engine (peaked tiny checkpoint, head_dim 64).

1. Batched == alone, per kind: greedy tokens of a request batched with others (mixed
   lengths, prompts longer than a chunk, late joins, aborts) equal the same request run
   alone with the same cache kind, token for token.
2. Agreement with the fp cache: greedy tokens over 256 generated tokens per prompt
   (teacher-forced, see AGREEMENT_MIN).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.factory import kv_store_factory
from deltaserve.engine.config import EngineConfig, KVCacheConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint

KINDS = {
    "affine4": KVCacheConfig(kind="affine", bits=4),
    "affine8": KVCacheConfig(kind="affine", bits=8),
    "tq_k8v3": KVCacheConfig(kind="turboquant", key_bits=8, value_bits=3),
    "affine8_start16": KVCacheConfig(kind="affine", bits=8, start=16),
}
MAX_TOKENS = 10
# Teacher-forced greedy agreement with fp: for 4 prompts, fp greedily generates 256 tokens;
# each kind then reads the same prompt + tokens and picks its own greedy token after every
# prefix. Measured on this checkpoint: fp 100%, affine-8 99.8%, affine-4 97.1%, TQ K8V3
# 95.6% (K4V4 97.3%, K8V4 98.1%, K3V3 94.8%). Free-running agreement is not used: one
# near-tie flip (affine-8 flips a 0.027-nat tie at token 34 of one prompt) changes every
# later token, so it measures where the first near-tie is, not the cache's error.
AGREEMENT_MIN = {"affine8": 0.99, "affine4": 0.95, "tq_k8v3": 0.93}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(str(cached_checkpoint("tiny")))


def _config(kv: KVCacheConfig) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=48, max_prefill_chunk=24, kv_cache=kv
    )


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(count: int, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 240000) for _ in range(rng.choice(lengths))] for _ in range(count)]


PROMPTS = _prompts(6, seed=11, lengths=(1, 3, 17, 40, 70))
_ALONE: dict[tuple[str, int], list[int]] = {}


def _alone(loaded: LoadedModel, kind: str, i: int) -> list[int]:
    """Greedy tokens of PROMPTS[i] run alone (cached: greedy with fewer tokens is a prefix)."""
    if (kind, i) not in _ALONE:
        out = LLMEngine(loaded, _config(KINDS[kind])).generate([PROMPTS[i]], _greedy(MAX_TOKENS))
        _ALONE[kind, i] = out[0].token_ids
    return _ALONE[kind, i]


@pytest.mark.parametrize("kind", list(KINDS))
def test_batched_equals_alone(loaded: LoadedModel, kind: str) -> None:
    """All prompts at once, with staggered lengths of output (rows leave early)."""
    params = [_greedy(MAX_TOKENS - i % 4) for i in range(len(PROMPTS))]
    batched = LLMEngine(loaded, _config(KINDS[kind])).generate(PROMPTS, params)
    for i, (p, got) in enumerate(zip(params, batched, strict=True)):
        assert got.token_ids == _alone(loaded, kind, i)[: p.max_tokens]


@pytest.mark.parametrize("kind", list(KINDS))
def test_late_joins_and_aborts(loaded: LoadedModel, kind: str) -> None:
    engine = LLMEngine(loaded, _config(KINDS[kind]))
    reqs = [
        GenerationRequest(f"r{i}", tuple(p), _greedy(MAX_TOKENS)) for i, p in enumerate(PROMPTS)
    ]
    joins, aborts = {0: reqs[:2], 3: reqs[2:4], 6: reqs[4:]}, {4: ["r1"], 8: ["r4"]}
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or step <= max(joins):
        for req in joins.get(step, []):
            engine.add_request(req)
        for request_id in aborts.get(step, []):
            engine.abort(request_id)
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        step += 1
    for i in range(len(PROMPTS)):
        ref, got = _alone(loaded, kind, i), tokens.get(f"r{i}", [])
        if i in (1, 4):
            assert got == ref[: len(got)] and len(got) < MAX_TOKENS
        else:
            assert got == ref


def _teacher_forced_argmax(
    loaded: LoadedModel, kv: KVCacheConfig, seq: list[int], first: int
) -> list[int]:
    """Greedy token after each prefix seq[: i + 1], i >= first, with a `kv` cache (the
    sequence runs through the model in chunks of 64 tokens)."""
    state = BatchState.empty(loaded.config, kv_store_factory(kv))
    out: list[int] = []
    for lo in range(0, len(seq), 64):
        chunk = seq[lo : lo + 64]
        tokens = mx.array([chunk], dtype=mx.int32)
        group = ForwardGroup(tokens, text_positions([lo], len(chunk)), state.layers)
        hidden = loaded.model([group])[0][0, max(0, first - lo) :]
        if hidden.shape[0]:
            out.extend(mx.argmax(loaded.model.logits(hidden), axis=-1).tolist())
    return out


def _agreement(loaded: LoadedModel, kv: KVCacheConfig, fp_runs: list) -> float:
    """Share of the fp greedy continuations' tokens that the `kv` cache also picks when
    fed the same prefix (teacher-forced greedy agreement)."""
    same = total = 0
    for prompt, tokens in fp_runs:
        picks = _teacher_forced_argmax(loaded, kv, prompt + tokens[:-1], len(prompt) - 1)
        same += sum(a == b for a, b in zip(picks, tokens, strict=True))
        total += len(tokens)
    return same / total


@pytest.fixture(scope="module")
def fp_runs(loaded: LoadedModel) -> list[tuple[list[int], list[int]]]:
    """(prompt, 256 greedy tokens with the fp cache) for 4 prompts."""
    prompts = _prompts(4, seed=21, lengths=(20, 60, 120))
    out = LLMEngine(loaded, _config(KVCacheConfig())).generate(prompts, _greedy(256))
    return [(p, c.token_ids) for p, c in zip(prompts, out, strict=True)]


@pytest.mark.parametrize("kind", ["fp", *AGREEMENT_MIN])
def test_greedy_agreement_with_fp(loaded: LoadedModel, fp_runs: list, kind: str) -> None:
    kv = KVCacheConfig() if kind == "fp" else KINDS[kind]
    assert _agreement(loaded, kv, fp_runs) >= AGREEMENT_MIN.get(kind, 0.99)
