"""The GPU defaults, run on the CPU: the compiled decode step (engine/decode.py) and
batched prefill (engine/runner.py cohorts) give the plain path's tokens, token for token.

Runs the real engine both ways on the peaked tiny checkpoints, for every KV kind, with
joins, leaves, aborts and batch sizes that change every few steps (each a new trace), and
checks batched == alone with both on.
"""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import pytest

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.factory import kv_store_factory
from deltaserve.engine.cache.kv import KVStore
from deltaserve.engine.config import EngineConfig, KVCacheConfig
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.testing import cached_checkpoint

KINDS = {
    "fp": KVCacheConfig(),
    "affine8": KVCacheConfig(kind="affine", bits=8),
    "tq_k8v3": KVCacheConfig(kind="turboquant", key_bits=8, value_bits=3),
}
BASE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=48, max_prefill_chunk=24)


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    # float32 on every device, as tests/test_compiled_prompt.py says why
    return load_model(str(cached_checkpoint(request.param)), dtype=mx.float32)


def _config(
    compiled: bool, kv: KVCacheConfig = KINDS["fp"], batch_prefill: bool = False
) -> EngineConfig:
    return dataclasses.replace(
        BASE, compile_decode=compiled, kv_cache=kv, batch_prefill=batch_prefill
    )


def _requests(count: int, seed: int, max_tokens: int = 12) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(100, 240000) for _ in range(rng.choice([1, 5, 30, 70]))]
        params = SamplingParams(
            temperature=0.0, max_tokens=rng.choice([3, max_tokens]), ignore_eos=True
        )
        out.append(GenerationRequest(f"r{i}", tuple(prompt), params))
    return out


def _arrive(engine: LLMEngine, arrivals: dict[int, list[GenerationRequest]]) -> dict:
    """Requests join at the steps `arrivals` names; tokens per request id once all end."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or step <= max(arrivals):
        for req in arrivals.get(step, ()):
            engine.add_request(req)
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        step += 1
    return tokens


def _drive(engine: LLMEngine, requests: list[GenerationRequest], abort: str = "") -> dict:
    """Requests join two per step; `abort` leaves at step 6. Tokens per request id."""
    tokens: dict[str, list[int]] = {}
    step, pending = 0, list(requests)
    while engine.has_work() or pending:
        for req in pending[:2]:
            engine.add_request(req)
        pending = pending[2:]
        if step == 6 and abort:
            engine.abort(abort)
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        step += 1
    return tokens


@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_equals_uncompiled(loaded: LoadedModel, kind: str) -> None:
    """Joins every step, rows leaving at different steps, an abort: same tokens."""
    requests = _requests(10, seed=len(kind))
    plain = _drive(LLMEngine(loaded, _config(False, KINDS[kind])), requests, abort="r3")
    compiled_engine = LLMEngine(loaded, _config(True, KINDS[kind]))
    assert compiled_engine.runner.compiled is not None
    compiled = _drive(compiled_engine, requests, abort="r3")
    assert compiled == plain


def test_compiled_batched_equals_alone(loaded: LoadedModel) -> None:
    """With both GPU paths on, a request's tokens do not depend on the rows beside it
    (alone: plain decode, one group per chunk)."""
    requests = _requests(6, seed=7)
    batched = _drive(LLMEngine(loaded, _config(True, batch_prefill=True)), requests)
    for req in requests:
        alone = _drive(LLMEngine(loaded, _config(False)), [req])
        assert batched[req.request_id] == alone[req.request_id], req.request_id


@pytest.mark.parametrize("kind", [*KINDS, "affine8_start16"])
def test_batched_prefill_equals_one_group_per_chunk(loaded: LoadedModel, kind: str) -> None:
    """Chunks of several prompts in one left-padded group (first chunks of any length;
    later chunks of equal length) give the tokens of one group per chunk, every KV kind."""
    kv = KINDS.get(kind) or KVCacheConfig(kind="affine", bits=8, start=16)
    requests = _requests(10, seed=11)
    plain = _drive(LLMEngine(loaded, _config(False, kv)), requests, abort="r5")
    batched_engine = LLMEngine(loaded, _config(False, kv, batch_prefill=True))
    assert batched_engine.runner.batch_prefill
    assert _drive(batched_engine, requests, abort="r5") == plain


def test_compiled_step_grows_the_store_past_its_capacity(loaded: LoadedModel) -> None:
    """A row decoding across a capacity step (256 columns) keeps its tokens."""
    prompt = tuple(range(1000, 1250))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    req = [GenerationRequest("long", prompt, params)]
    config = dataclasses.replace(BASE, max_num_batched_tokens=256, max_prefill_chunk=256)
    plain = _drive(LLMEngine(loaded, dataclasses.replace(config, compile_decode=False)), req)
    compiled = _drive(LLMEngine(loaded, dataclasses.replace(config, compile_decode=True)), req)
    assert compiled == plain


def test_prefix_kv_keeps_the_uncompiled_path(loaded: LoadedModel) -> None:
    """kv_cache.start > 0 (PrefixKV) has no traced form: the engine says so and runs
    uncompiled rather than failing."""
    kv = KVCacheConfig(kind="affine", bits=8, start=16)
    engine = LLMEngine(loaded, _config(True, kv))
    assert engine.runner.compiled is None
    state = BatchState.empty(loaded.config, kv_store_factory(kv))
    assert not CompiledDecode.supports(state)


def test_merge_and_filter_leave_growth_headroom() -> None:
    """After a join or a leave the KV arrays keep free columns, so the next decode
    append writes in place instead of copying the whole batch."""
    a, b = KVStore.__new__(KVStore), KVStore.__new__(KVStore)
    for store, length in ((a, 5), (b, 9)):
        KVStore.__init__(store)
        store.encode = lambda k, v: [k, v]  # type: ignore[method-assign]
        x = mx.ones((1, 2, length, 4))
        store.store(x, x, None)
    a.merge(b)
    assert a.size == 9 and a.capacity > a.size
    a.filter([1])
    assert a.size == 9 and a.capacity > a.size
    before = a.arrays[0]
    a.reserve(1)
    assert a.arrays[0] is before  # room was there: no copy


def test_every_gpu_path_under_load_gives_the_plain_engines_tokens() -> None:
    """The GPU's default paths together (compiled decode, fresh prompts and later chunks,
    batched prefill, pipelined steps, the decode forward queued first, the prefix cache;
    and the decode rows' tokens read back first, a switch off by default)
    at up to 32 rows, with prompts of 40-400 tokens arriving in waves while others
    decode, half of them sharing a prefix (next turns of a chat: restored rows whose rest
    runs as later chunks): the tokens of an engine with every one of those paths off."""
    loaded = load_model(str(cached_checkpoint("tiny")), dtype=mx.float32)
    rng = random.Random(11)
    shared = [rng.randrange(100, 240000) for _ in range(120)]
    requests = []
    for i in range(48):
        rest = [rng.randrange(100, 240000) for _ in range(rng.randint(40, 280))]
        prompt = (shared if i % 2 else []) + rest
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 24), ignore_eos=True)
        requests.append(GenerationRequest(f"r{i}", tuple(prompt), params))
    base = EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=384, max_prefill_chunk=128,
        prefix_block_tokens=16, prefix_min_tokens=16, warm_up_seconds=0,
    )  # fmt: skip
    gpu = dataclasses.replace(
        base, compile_decode=True, compile_prompt=True, compile_chunks=True,
        batch_prefill=True, pipeline_steps=True, submit_decode_first=True,
        publish_decode_first=True,
    )  # fmt: skip
    plain = dataclasses.replace(
        base, compile_decode=False, compile_prompt=False, compile_chunks=False,
        batch_prefill=False, pipeline_steps=False, submit_decode_first=False,
        publish_decode_first=False,
    )  # fmt: skip

    # 8 at once, 16 at once while they decode, then one a step
    arrivals = {0: requests[:8], 10: requests[8:24]}
    arrivals |= {20 + i: [req] for i, req in enumerate(requests[24:])}

    def waves(config: EngineConfig) -> tuple[dict, LLMEngine]:
        engine = LLMEngine(loaded, config)
        return _arrive(engine, arrivals), engine

    got, engine = waves(gpu)
    assert engine.runner.compiled is not None and engine.runner.compile_chunks
    assert engine.runner.submit_decode_first
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.hit_tokens > 0
    want, _ = waves(plain)
    assert len(got) == 48 and got == want


@pytest.mark.parametrize("kernels", [False, True])
def test_packed_mixed_steps_give_the_compiled_steps_tokens(kernels: bool) -> None:
    """A GPU's packed mixed step (engine/packed_step.py: pack_token_wise with the compiled
    paths on): a step with decode rows and fresh prompts runs them as one forward whose
    groups share each matmul (the decode batch's dead rows included), each layer a
    compiled call of its kind's trace, instead of the compiled decode and prompt
    forwards; same tokens as those, with the DeltaNet layers' kernel paths (decode
    token, prompt chunk: their ops references here) on or off. Waves of prompts while
    rows decode, with later chunks and a shared prefix (steps the packed forward does
    not take), and a burst of two cohorts (one packed step of two prompt blocks). As on
    a GPU, a prefix-cache snapshot ends a chunk (compile_prefill) rather than splitting
    it, and prompts are admitted at the token budget (the stall bound off)."""
    from deltaserve.engine.packed_step import PackedMixedStep
    from deltaserve.models.deltanet import GatedDeltaNet

    loaded = load_model(str(cached_checkpoint("tiny")), dtype=mx.float32)
    mixers = [m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet)]
    rng = random.Random(5)
    shared = [rng.randrange(100, 240000) for _ in range(64)]
    requests = []
    for i in range(20):
        # most prompts fit one chunk (the packed forward's), every fourth takes two
        length = rng.randint(80, 150) if i % 4 == 1 else rng.randint(10, 60)
        rest = [rng.randrange(100, 240000) for _ in range(length)]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(6, 16), ignore_eos=True)
        prompt = (shared if i % 5 == 0 else []) + rest
        requests.append(GenerationRequest(f"r{i}", tuple(prompt), params))
    arrivals = {0: requests[:4]} | {3 + 2 * i: [r] for i, r in enumerate(requests[4:])}
    # a burst while rows decode: fresh prompts in two cohorts (a chunk's area each), one
    # packed step of two prompt blocks (under 16 tokens: no prefix-cache snapshot)
    burst = []
    for i, length in enumerate((15, 14, 13, 12, 9, 5)):
        prompt = tuple(rng.randrange(100, 240000) for _ in range(length))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        burst.append(GenerationRequest(f"b{i}", prompt, params))
    arrivals[12] = arrivals.get(12, []) + burst
    base = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=96, max_prefill_chunk=64, warm_up_seconds=0,
        compile_decode=True, compile_prompt=True, compile_chunks=True, batch_prefill=True,
        prefix_block_tokens=16, prefix_min_tokens=16, max_stall_factor=0, compile_prefill=True,
    )  # fmt: skip

    def run(pack: bool) -> tuple[dict, list[int]]:
        for m in mixers:
            m.fused_chunk = m.fused_decode = kernels or None
        engine = LLMEngine(loaded, dataclasses.replace(base, pack_token_wise=pack))
        runner, ran = engine.runner, []
        # a GPU's with pack_token_wise (the CPU's runner has none)
        runner.packed = PackedMixedStep(loaded.model) if pack else None
        packed = runner._packed

        def counted(plan: object, cohorts: list) -> object:
            out = packed(plan, cohorts)
            ran.append(len(out[1]) if out is not None else 0)  # its prompt blocks
            return out

        runner._packed = counted
        tokens = _arrive(engine, arrivals)
        for m in mixers:
            m.fused_chunk = m.fused_decode = None
        return tokens, ran

    got, blocks = run(True)
    want, _ = run(False)
    assert sum(1 for b in blocks if b) >= 3, "steps with decode rows and fresh prompts ran packed"
    assert max(blocks) >= 2, "a step packed two prompt blocks"
    assert len(got) == 26 and got == want
