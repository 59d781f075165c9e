"""Speculative decoding with the MTP head inside the engine (engine/speculative.py).

Greedy output with speculation equals greedy output without, token for token: with the
checkpoint's own MTP head (random weights: it drafts almost nothing right, so rows also
pause and retry, moving between the verify and decode batches), and with a forced draft
source (each row's true greedy continuation with some drafts corrupted), which makes
every accepted count 0..k happen inside the engine, next to joins, leaves, aborts,
quantized KV, n > 1, max_tokens and stop tokens inside an accepted run, logprobs, a
constrained row and an image row in the batch. Sampled rows speculate too: seeded ones
reproducibly and alone as batched, with forced drafts accepting varying counts and
ending exactly; a speculating row's budget share holds the head's KV.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import mlx.core as mx
import pytest
from test_engine_batching import _drive as drive
from test_engine_images import image, prompt_with

from deltaserve.engine.cache import kv as kv_module
from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.config import EngineConfig, KVCacheConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.sampling.sampler import Sampler, SamplingRow
from deltaserve.engine.scheduling.speculation import Speculation
from deltaserve.engine.speculative import Drafter, DraftRound, VerifyStep
from deltaserve.engine.structured.spec import Constraint
from deltaserve.engine.types import GenerationRequest, SamplingParams, TokenLogprob
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.deltanet import GatedDeltaNet
from deltaserve.models.testing import cached_checkpoint

SMALL = EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, max_prefill_chunk=24)
K = 3
KV_KINDS = [
    KVCacheConfig(),
    KVCacheConfig(kind="affine", bits=8),
    KVCacheConfig(kind="turboquant", key_bits=8, value_bits=3),
]


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    # float32 on every device (the CPU's default anyway): on a GPU (bench/gpu_tests.sh)
    # bf16 rounds a [B, k + 1] verify and a [B, 1] decode step differently, and random
    # weights have near ties, so token equality would test the rounding, not the code
    return load_model(str(cached_checkpoint(request.param)), dtype=mx.float32)


@pytest.fixture(autouse=True)
def _acceptance_floor_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured break-even depends on timing (on this CPU a verify costs more than k
    accepted drafts repay, so rows would stop drafting after their first timed verifies):
    here rows keep the acceptance floor, so every test speculates as long as its drafts
    land. tests/test_speculation_policy.py covers the measured rule."""
    monkeypatch.setattr(Speculation, "break_even", lambda self: None)


def _spec(config: EngineConfig = SMALL, k: int = K) -> EngineConfig:
    return dataclasses.replace(config, speculative="mtp", num_speculative_tokens=k)


def _greedy(max_tokens: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([1, 3, 17, 40, 70]) for _ in range(count)]
    return [[rng.randrange(100, 240000) for _ in range(n)] for n in lengths]


def _drive(
    engine: LLMEngine, joins: dict[int, list[GenerationRequest]], aborts: dict | None = None
) -> dict[tuple[str, int], list[int]]:
    """Step the engine, adding and aborting requests at given steps; tokens per choice."""
    return drive(engine, joins, aborts, key=lambda delta: (delta.request_id, delta.index))


def _joins(prompts: list[list[int]], params: SamplingParams) -> dict:
    """Requests r0.. joining two per step."""
    joins: dict[int, list[GenerationRequest]] = {}
    for i, p in enumerate(prompts):
        joins.setdefault(i // 2, []).append(GenerationRequest(f"r{i}", tuple(p), params))
    return joins


def force_drafts(
    engine: LLMEngine,
    oracle: dict[str, list[int]],
    wrong: Callable[[str, int, int], int],
) -> set[int]:
    """Make the engine's drafter propose each row's true continuation (oracle[row_id],
    the greedy tokens after its prompt) with draft wrong(row, round, k) corrupted (index k:
    none), as certain drafts (q one-hot on each); the head still runs, so its store is
    kept as usual. Returns the accepted counts seen, filled as the engine runs. A chained
    verify's drafts (pipeline_verify) are gathered lazily: its rows' tokens read back so
    far, plus those the verify before it keeps, still computing."""
    drafter = engine.runner.drafter
    assert drafter is not None
    draft, read_back, seen = drafter.draft, drafter.read_back, set()
    k = drafter.num_draft
    rounds: dict[str, int] = {}

    def forced(
        row_ids: list[str], state: BatchState, last: mx.array, rows: list[SamplingRow]
    ) -> DraftRound:
        draft(row_ids, state, last, rows)
        runner = engine.runner
        before = runner.chain_source  # a chained verify's: the acceptance it follows
        width = max(len(oracle[r]) for r in row_ids) + 2 * (k + 1)
        table = mx.array([oracle[r] + [0] * (width - len(oracle[r])) for r in row_ids])
        emitted = mx.array([len(runner.rows.output_ids[r]) for r in row_ids])
        if before is not None:
            emitted = emitted + before.num_accepted + 1
        true = mx.take_along_axis(table, emitted[:, None] + mx.arange(k)[None], axis=1)
        bad = []
        for row_id in row_ids:
            bad.append(wrong(row_id, rounds.get(row_id, 0), k))
            rounds[row_id] = rounds.get(row_id, 0) + 1
        corrupt = mx.arange(k)[None] == mx.array(bad)[:, None]
        return DraftRound((true + corrupt).astype(mx.int32), None)

    def recording(verdicts, state, rows, *chained):  # type: ignore[no-untyped-def]
        runs = read_back(verdicts, state, rows, *chained)
        seen.update(len(r.token_ids) - 1 for r in runs)
        return runs

    drafter.draft = forced  # type: ignore[method-assign]
    drafter.read_back = recording  # type: ignore[method-assign]
    return seen


def _cycle(row_id: str, round_: int, k: int) -> int:
    """Corrupt a different draft each round (and none every k + 1-th)."""
    return (round_ + sum(map(ord, row_id))) % (k + 1)


def _oracle(
    loaded: LoadedModel, joins: dict, extra: int = K + 1, config: EngineConfig = SMALL
) -> dict[str, list[int]]:
    """Each request's greedy tokens without speculation, a few past its max_tokens."""
    engine = LLMEngine(loaded, config)
    longer = {
        s: [
            dataclasses.replace(
                r, params=dataclasses.replace(r.params, max_tokens=r.params.max_tokens + extra)
            )
            for r in reqs
        ]
        for s, reqs in joins.items()
    }
    return {f"{rid}/{i}": t for (rid, i), t in _drive(engine, longer).items()}


def test_mtp_head_keeps_greedy_output(loaded: LoadedModel) -> None:
    """The checkpoint's own head drafting (rows pausing and retrying) changes no token;
    its drafts are counted."""
    prompts = _prompts(10, seed=1)
    joins = _joins(prompts, _greedy(max_tokens=14))
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    engine = LLMEngine(loaded, _spec())
    assert _drive(engine, joins) == plain
    assert engine.speculation is not None and engine.speculation.stats.num_drafted > 0
    assert not engine.states.verify_ids and not engine.states.decode_ids


def test_a_request_may_turn_speculation_off(loaded: LoadedModel) -> None:
    """speculative=False rows never draft beside rows that do, and keep their tokens."""
    prompts = _prompts(6, seed=11)
    off = _greedy(max_tokens=14, speculative=False)
    joins = {i // 2: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        params = off if i % 2 else _greedy(max_tokens=14)
        joins[i // 2].append(GenerationRequest(f"r{i}", tuple(prompt), params))
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    engine = LLMEngine(loaded, _spec())
    drafted: dict[str, int] = {}
    observe = engine.speculation.observe

    def recording(req, num_drafted, accepted, step):  # type: ignore[no-untyped-def]
        drafted[req.request_id] = drafted.get(req.request_id, 0) + num_drafted
        observe(req, num_drafted, accepted, step)

    engine.speculation.observe = recording  # type: ignore[method-assign]
    assert _drive(engine, joins) == plain
    assert {r for r, n in drafted.items() if n} == {"r0", "r2", "r4"}


@pytest.mark.parametrize(("k", "batch_prefill"), [(1, False), (2, False), (3, False), (2, True)])
def test_forced_drafts_accept_every_count_and_keep_greedy_output(
    loaded: LoadedModel, k: int, batch_prefill: bool
) -> None:
    """Drafts right up to a different position each round: every count 0..k is accepted
    somewhere, rows disagree within a step, output is exact, late joins included (and
    prompts prefilled in cohorts, the GPU's way)."""
    prompts = _prompts(8, seed=2)
    joins = _joins(prompts, _greedy(max_tokens=16))
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    config = dataclasses.replace(SMALL, batch_prefill=batch_prefill)
    engine = LLMEngine(loaded, _spec(config, k=k))
    seen = force_drafts(engine, _oracle(loaded, joins), _cycle)
    assert _drive(engine, joins) == plain
    assert seen == set(range(k + 1)), seen
    stats = engine.speculation.stats
    assert 0 < stats.num_accepted < stats.num_drafted


def test_pipelined_steps_still_speculate(loaded: LoadedModel) -> None:
    """With steps pipelined (the GPU's default), a row that may draft has its plain step
    read back before the next plan, so it does draft: every accepted count 0..k is seen
    and the output is that of a pipelined engine without speculation. (A pipelined step's
    token is still in flight when the next plan is made, and such a row cannot draft:
    before, a row drafted on a GPU only after a step that happened to run in lockstep.)
    With submit_decode_first, as on a GPU, each verify step queues its draft chain
    before its verify forward is built."""
    config = dataclasses.replace(SMALL, pipeline_steps=True, submit_decode_first=True)
    joins = _joins(_prompts(6, seed=4), _greedy(max_tokens=16))
    plain = _drive(LLMEngine(loaded, config), joins)
    engine = LLMEngine(loaded, _spec(config))
    assert engine.pipeline and engine.runner.submit_decode_first
    seen = force_drafts(engine, _oracle(loaded, joins), _cycle)
    assert _drive(engine, joins) == plain
    assert seen == set(range(K + 1)), seen


def _chaining(config: EngineConfig) -> EngineConfig:
    """A GPU's verify steps on the CPU: compiled, pipelined, chained (pipeline_verify)."""
    return dataclasses.replace(
        config, compile_decode=True, pipeline_steps=True, pipeline_verify=True,
        submit_decode_first=True,
    )  # fmt: skip


def _count_chained(engine: LLMEngine) -> list[int]:
    """The engine's chained verify plans, counted as it runs (their rows per step)."""
    counts: list[int] = []
    chained_plan = engine.scheduler.chained_plan

    def counting() -> object:
        plan = chained_plan()
        if plan is not None:
            counts.append(len(plan.verify_row_ids))
        return plan

    engine.scheduler.chained_plan = counting  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("kv", KV_KINDS, ids=["fp", "affine8", "turboquant"])
def test_chained_verifies_keep_greedy_output(loaded: LoadedModel, kv: KVCacheConfig) -> None:
    """pipeline_verify (the GPU's default): a verify step of the same rows is built while
    the one before computes, its last tokens, positions and rollback lazy. Per KV kind,
    with every accepted count 0..k, rows joining (the chain breaks for their prompts and
    resumes), an abort and rows ending at max_tokens or a stop token: the tokens equal
    the plain engine's, chained verifies ran, and every row's state is freed."""
    config = dataclasses.replace(SMALL, kv_cache=kv)
    prompts = _prompts(6, seed=5)
    oracle = _oracle(loaded, _joins(prompts, _greedy(max_tokens=30)), config=config)
    joins = _joins(prompts, _greedy(max_tokens=30))
    # r1 ends at a stop token inside a run (chained onto or chained after), r3 earlier
    r1, r3 = joins[0][1], joins[1][1]
    joins[0][1] = dataclasses.replace(r1, params=_greedy(30, stop_token_ids=(oracle["r1/0"][17],)))
    joins[1][1] = dataclasses.replace(r3, params=_greedy(23))
    aborts = {12: ["r4"]}
    plain = _drive(LLMEngine(loaded, config), joins, aborts)
    engine = LLMEngine(loaded, _spec(_chaining(config)))
    assert engine.runner.chain_verify
    chained = _count_chained(engine)
    seen = force_drafts(engine, oracle, _cycle)
    got = _drive(engine, joins, aborts)
    assert {r: t for r, t in got.items() if r[0] != "r4"} == {
        r: t for r, t in plain.items() if r[0] != "r4"
    }
    assert len(got[("r4", 0)]) < 30 and len(got[("r1", 0)]) == 18
    assert seen == set(range(K + 1)), seen
    assert len(chained) >= 3 and max(chained) > 1, chained
    assert not engine.scheduler.rows and engine.states.verify.num_rows == 0


def test_a_chained_batch_drops_the_padding_its_rejections_leave(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that keeps verifying chained grows by k + 1 columns a step, its rejected
    drafts becoming left padding (KVStore.rollback_pending); once every row has
    COMPACT_PAD of it, settle drops it: with a small COMPACT_PAD the stores compact
    mid-chain, rows with all drafts wrong, and the tokens still equal the plain engine's."""
    monkeypatch.setattr(kv_module, "COMPACT_PAD", 4)
    prompts = _prompts(2, seed=6)
    joins = {0: [GenerationRequest(f"r{i}", tuple(p), _greedy(40)) for i, p in enumerate(prompts)]}
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    oracle = _oracle(loaded, joins)
    engine = LLMEngine(loaded, _spec(_chaining(SMALL)))
    chained = _count_chained(engine)
    pads: list[int] = []
    settle = kv_module.KVStore.settle

    def recording(self: kv_module.KVStore, drop: list[int]) -> None:
        settle(self, drop)
        pads.append(min(self.left_pad))

    monkeypatch.setattr(kv_module.KVStore, "settle", recording)
    force_drafts(engine, oracle, lambda row, r, k: 0 if r % 2 else k)  # all wrong, all right
    assert _drive(engine, joins) == plain
    assert len(chained) >= 5 and pads and max(pads) < 4 + 2 * K, pads
    assert any(p == 0 for p in pads) and any(p > 0 for p in pads), pads


def test_a_request_arriving_mid_chain_breaks_it(loaded: LoadedModel) -> None:
    """Chained verifies run while nothing else waits: a request arriving reads the verify
    in flight back first (its prompt then runs beside the rows as usual), and the chain
    resumes once every row decodes again; tokens as the plain engine's."""
    prompts = _prompts(3, seed=7)
    joins = {
        0: [GenerationRequest("r0", tuple(prompts[0]), _greedy(36))],
        12: [GenerationRequest("r1", tuple(prompts[1]), _greedy(20))],
        13: [GenerationRequest("r2", tuple(prompts[2]), _greedy(20))],
    }
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    oracle = _oracle(loaded, joins)
    engine = LLMEngine(loaded, _spec(_chaining(SMALL)))
    chained = _count_chained(engine)
    force_drafts(engine, oracle, lambda row, r, k: k)
    assert _drive(engine, joins) == plain
    assert 1 in chained and any(c > 1 for c in chained), chained


def test_plain_rows_decode_beside_a_chain(loaded: LoadedModel) -> None:
    """Rows that do not speculate (their request turned it off) decode beside chained
    verifies, their inputs the step in flight's sampled tokens: tokens as the plain
    engine's, and chained steps had both kinds of rows."""
    prompts = _prompts(4, seed=10)
    plain_params = _greedy(24, speculative=False)
    joins = {0: [
        GenerationRequest(f"r{i}", tuple(p), plain_params if i % 2 else _greedy(24))
        for i, p in enumerate(prompts)
    ]}  # fmt: skip
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    oracle = _oracle(loaded, joins)
    engine = LLMEngine(loaded, _spec(_chaining(SMALL)))
    mixed: list[int] = []
    chained_plan = engine.scheduler.chained_plan

    def counting() -> object:
        plan = chained_plan()
        if plan is not None and plan.decode_row_ids:
            mixed.append(len(plan.decode_row_ids))
        return plan

    engine.scheduler.chained_plan = counting  # type: ignore[method-assign]
    force_drafts(engine, oracle, _cycle)
    assert _drive(engine, joins) == plain
    assert len(mixed) >= 3 and max(mixed) == 2, mixed


def test_rows_a_chain_cannot_take_verify_in_lockstep(loaded: LoadedModel) -> None:
    """Sampled rows (and rows with penalties or a grammar) read their tokens on the host
    to build the next verify, so no verify is chained onto theirs (ModelRunner.chains):
    a seeded sampled row writes the same text with pipeline_verify on or off."""
    prompts = _prompts(2, seed=8)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    joins = {0: [GenerationRequest(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)]}
    base = dataclasses.replace(_chaining(SMALL), pipeline_verify=False)
    unchained = _drive(LLMEngine(loaded, _spec(base)), joins)
    engine = LLMEngine(loaded, _spec(_chaining(SMALL)))
    chained = _count_chained(engine)
    assert _drive(engine, joins) == unchained
    assert not chained


@pytest.mark.parametrize("kv", KV_KINDS, ids=["fp", "affine8", "turboquant"])
def test_every_kv_kind_with_aborts_mid_draft(loaded: LoadedModel, kv: KVCacheConfig) -> None:
    """Per KV kind, with rows aborted while they speculate: the others' tokens equal the
    same kind without speculation, and every row's state is freed."""
    config = dataclasses.replace(SMALL, kv_cache=kv)
    prompts = _prompts(6, seed=3)
    joins = _joins(prompts, _greedy(max_tokens=14))
    aborts = {6: ["r1"], 8: ["r4"]}
    plain = _drive(LLMEngine(loaded, config), joins, aborts)
    engine = LLMEngine(loaded, _spec(config))
    force_drafts(engine, _oracle(loaded, joins), _cycle)
    got = _drive(engine, joins, aborts)
    assert {r: t for r, t in got.items() if r[0] not in ("r1", "r4")} == {
        r: t for r, t in plain.items() if r[0] not in ("r1", "r4")
    }
    assert len(got[("r1", 0)]) < 14 and len(got[("r4", 0)]) < 14
    assert not engine.scheduler.rows and not engine.states.verify_ids
    assert not engine.states.prefill and engine.states.verify.num_rows == 0


@pytest.mark.parametrize("kv", KV_KINDS, ids=["fp", "affine8", "turboquant"])
def test_compiled_verify_keeps_tokens(loaded: LoadedModel, kv: KVCacheConfig) -> None:
    """With compile_decode on, the verify batch runs as the compiled verify
    (CompiledDecode.verify: k + 1 columns, every column's DeltaNet state kept) at bucket
    sizes, dead rows after the live ones: every accepted count 0..k, joins and an abort
    give the tokens of the eager engine without speculation, and the verify forwards did
    go through the compiled function."""
    config = dataclasses.replace(SMALL, kv_cache=kv)
    prompts = _prompts(6, seed=9)
    joins = _joins(prompts, _greedy(max_tokens=20))
    aborts = {7: ["r2"]}
    plain = _drive(LLMEngine(loaded, config), joins, aborts)
    # with a GPU's mixed steps (decode rows' tokens drawn and read back ahead of prompts)
    # and verify steps (the draft chain queued before the verify forward is built)
    gpu = dataclasses.replace(
        config, compile_decode=True, publish_decode_first=True, submit_decode_first=True
    )
    engine = LLMEngine(loaded, _spec(gpu))
    compiled = engine.runner.compiled
    assert compiled is not None
    calls = []
    verify = compiled.verify

    def counting(tokens: mx.array, offsets: list[int], state: BatchState) -> tuple:
        calls.append((state.num_rows, tokens.shape[1], tokens.shape[0]))
        return verify(tokens, offsets, state)

    compiled.verify = counting  # type: ignore[method-assign]
    seen = force_drafts(engine, _oracle(loaded, joins, config=config), _cycle)
    got = _drive(engine, joins, aborts)
    assert {r: t for r, t in got.items() if r[0] != "r2"} == {
        r: t for r, t in plain.items() if r[0] != "r2"
    }
    assert seen == set(range(K + 1)) and calls and all(c[1] == K + 1 for c in calls)
    # the verify batch is held at the decode batch's bucket sizes (dead rows after live)
    assert {rows for rows, _, _ in calls} <= {1, 2, 4, 8, 12, 16}
    assert any(rows > live for rows, _, live in calls)
    assert not engine.scheduler.rows and engine.states.verify.num_rows == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_verify_through_the_decode_kernel_keeps_tokens(
    loaded: LoadedModel, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the DeltaNet decode kernel on (kernels/deltanet_decode.py; on the CPU its ops
    path), a verify's DeltaNet layers run its many-column form (GatedDeltaNet._slots_kernel)
    and keep each column's state for the rollback: every accepted count 0..k, joins and an
    abort give the tokens of the engine without speculation, eager and compiled."""
    mixers = [m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet)]
    for m in mixers:
        monkeypatch.setattr(m, "fused_decode", True)
    columns: list[int] = []
    slots_kernel = GatedDeltaNet._slots_kernel

    def counting(self: GatedDeltaNet, x: mx.array, *args: object) -> mx.array:
        columns.append(x.shape[1])
        return slots_kernel(self, x, *args)

    monkeypatch.setattr(GatedDeltaNet, "_slots_kernel", counting)
    config = dataclasses.replace(SMALL, compile_decode=compiled)
    joins = _joins(_prompts(6, seed=4), _greedy(max_tokens=16))
    aborts = {6: ["r3"]}
    plain = _drive(LLMEngine(loaded, config), joins, aborts)
    engine = LLMEngine(loaded, _spec(config))
    seen = force_drafts(engine, _oracle(loaded, joins, config=config), _cycle)
    got = _drive(engine, joins, aborts)
    assert {r: t for r, t in got.items() if r[0] != "r3"} == {
        r: t for r, t in plain.items() if r[0] != "r3"
    }
    assert seen == set(range(K + 1))
    assert columns and set(columns) == {K + 1}  # every verify layer, k + 1 columns


def _greedy_case(
    loaded: LoadedModel, count: int, seed: int, max_tokens: int
) -> tuple[dict, dict[str, list[int]]]:
    """`count` greedy requests joining two per step, and their tokens without speculation
    (force_drafts' oracle)."""
    joins = _joins(_prompts(count, seed=seed), _greedy(max_tokens=max_tokens))
    return joins, _oracle(loaded, joins)


def _compiled_engine(loaded: LoadedModel) -> tuple[LLMEngine, Drafter]:
    """A speculating engine with the compiled decode step on, and its drafter."""
    engine = LLMEngine(loaded, _spec(dataclasses.replace(SMALL, compile_decode=True)))
    assert engine.runner.drafter is not None
    return engine, engine.runner.drafter


def test_batched_pairs_draft_as_row_by_row(loaded: LoadedModel) -> None:
    """When a verify batch is the same rows as the last one, its kept pairs reach the
    head right-aligned by one gather (Drafter's _VerifiedPairs) instead of row by row:
    the same drafts and draft logits, step for step, as a drafter made to go row by row
    (with rows joining, so both paths run, and forced drafts, so rows keep different
    counts of pairs)."""
    joins, oracle = _greedy_case(loaded, 5, seed=12, max_tokens=16)
    rounds: dict[bool, list] = {}
    for batched in (True, False):
        engine, drafter = _compiled_engine(loaded)
        draft, seen, hits = drafter.draft, [], []

        def recording(row_ids, state, last, rows, batched=batched, draft=draft, seen=seen,
                      hits=hits, drafter=drafter):  # type: ignore[no-untyped-def]  # fmt: skip
            held = drafter._verified
            hits.append(held is not None and held.row_ids == tuple(row_ids))
            if not batched:
                drafter._unbatch()
            out = draft(row_ids, state, last, rows)
            seen.append((tuple(row_ids), out.tokens.tolist(), out.logits))
            return out

        drafter.draft = recording  # type: ignore[method-assign]
        counts = force_drafts(engine, oracle, _cycle)  # wraps `recording`
        _drive(engine, joins)
        assert any(hits) and not all(hits) and len(counts) > 2, (hits, counts)
        rounds[batched] = seen
    assert len(rounds[True]) == len(rounds[False]) > 0
    for (ids_a, tok_a, lg_a), (ids_b, tok_b, lg_b) in zip(*rounds.values(), strict=True):
        assert ids_a == ids_b and tok_a == tok_b
        assert (lg_a is None) == (lg_b is None)
        if lg_a is not None:
            assert mx.allclose(lg_a, lg_b, atol=1e-4).item()


def test_compiled_draft_drafts_as_the_eager_chain(loaded: LoadedModel) -> None:
    """With compile_decode on, greedy batches draft through CompiledDraft (the head's
    chain traced, its store a KVView): the same drafts, step for step, as the eager
    chain, with rows joining and leaving (bucketed batches with dead rows, rows whose
    pairs are uneven or missing) and the head store left the same."""
    joins, oracle = _greedy_case(loaded, 6, seed=13, max_tokens=32)
    rounds: dict[bool, list] = {}
    for compiled in (True, False):
        engine, drafter = _compiled_engine(loaded)
        assert drafter.compiled is not None
        traced = drafter.compiled._fn
        calls = []

        def counting(*args: mx.array, traced=traced, calls=calls) -> list:  # type: ignore[no-untyped-def]
            calls.append(args[0].shape)
            return traced(*args)

        drafter.compiled._fn = counting
        if not compiled:
            drafter.compiled = None
        draft, seen = drafter.draft, []

        def recording(row_ids, state, last, rows, draft=draft, seen=seen):  # type: ignore[no-untyped-def]
            out = draft(row_ids, state, last, rows)
            store = state.draft
            seen.append((tuple(row_ids), out.tokens.tolist(), store.size, list(store.left_pad)))
            return out

        drafter.draft = recording  # type: ignore[method-assign]
        counts = force_drafts(engine, oracle, _cycle)
        _drive(engine, joins, {12: ["r3"]})
        assert len(counts) > 2 and bool(calls) == compiled
        rounds[compiled] = seen
    assert rounds[True] == rounds[False] and len(rounds[True]) >= 8


def test_a_step_whose_draft_chain_traced_reports_it(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify step whose compiled draft chain meets a new shape (rows, pairs a row, the
    head store's capacity) reports it as traced (StepResult.traced), as a new decode or
    verify shape is: its one-off cost then stays out of the speculation's break-even (on
    an H200 a few traced draft steps among a B = 1 row's first verifies priced a verify
    above what k drafts repay, and rows stopped drafting at 80% acceptance); a step
    that meets only known shapes reports none."""
    joins, oracle = _greedy_case(loaded, 3, seed=14, max_tokens=24)
    engine, drafter = _compiled_engine(loaded)
    assert drafter.compiled is not None
    compiled, call = drafter.compiled, drafter.compiled.__class__.__call__
    new_shape_steps: set[int] = set()
    step = [0]

    def watching(self, hidden, tokens, positions, pads, store):  # type: ignore[no-untyped-def]
        before = len(compiled.shapes)
        out = call(self, hidden, tokens, positions, pads, store)
        if len(compiled.shapes) > before:
            new_shape_steps.add(step[0])
        return out

    monkeypatch.setattr(type(compiled), "__call__", watching)  # call syntax looks it up there
    traced: dict[int, int] = {}
    update, execute = engine.scheduler.update, engine.runner.execute

    def plan_step(plan):  # type: ignore[no-untyped-def]
        step[0] = plan.step
        return execute(plan)

    def spy(plan, result):  # type: ignore[no-untyped-def]
        traced[plan.step] = result.traced
        return update(plan, result)

    engine.runner.execute = plan_step  # type: ignore[method-assign]
    engine.scheduler.update = spy  # type: ignore[method-assign]
    force_drafts(engine, oracle, _cycle)
    _drive(engine, joins)
    assert new_shape_steps, "no draft chain ran compiled"
    assert all(traced[s] >= 1 for s in new_shape_steps), (new_shape_steps, traced)
    repeats = [s for s, n in traced.items() if s not in new_shape_steps and n == 0]
    assert repeats, traced  # steps of known shapes report none


def test_several_rows_draft_at_one_width(loaded: LoadedModel) -> None:
    """Rows keeping different numbers of drafts (forced, every count 0 .. k) chain at
    k + 1 pairs a row whenever the verify batch has several rows (chain_width), so their
    compiled draft chain meets one shape per row bucket and store capacity; a row alone
    keeps its own width; the tokens are the plain engine's."""
    joins, oracle = _greedy_case(loaded, 5, seed=16, max_tokens=24)
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    engine, drafter = _compiled_engine(loaded)
    assert drafter.compiled is not None
    seen = force_drafts(engine, oracle, _cycle)
    assert _drive(engine, joins) == plain
    assert seen == set(range(K + 1))
    shapes = {rows_width for rows_width, _ in drafter.compiled.shapes}
    assert {width for rows, width in shapes if rows > 1} == {K + 1}, shapes
    assert any(rows > 1 for rows, _ in shapes)


def test_the_warm_up_traces_the_draft_chain(loaded: LoadedModel) -> None:
    """With a warm-up (a GPU's start-up; here warm_up_seconds on the CPU, compiled paths
    on), the head's compiled draft chain is traced for every verify batch size at the
    head store's first capacity: one row for every number of pairs it may bring (1 ..
    k + 1), several rows at k + 1 (chain_width), and the engine's tokens are a cold
    engine's."""
    config = _spec(dataclasses.replace(SMALL, max_num_seqs=2, compile_decode=True))
    warm = LLMEngine(loaded, dataclasses.replace(config, warm_up_seconds=600.0))
    drafter = warm.runner.drafter
    assert drafter is not None and drafter.compiled is not None
    warmed = {rows_width for rows_width, _ in drafter.compiled.shapes}
    assert warmed == {(1, width) for width in range(1, K + 2)} | {(2, K + 1)}
    joins, _ = _greedy_case(loaded, 2, seed=15, max_tokens=12)
    assert _drive(warm, joins) == _drive(LLMEngine(loaded, config), joins)


def test_max_tokens_and_stop_tokens_inside_an_accepted_run(loaded: LoadedModel) -> None:
    """All drafts right: a run of k + 1 tokens crosses max_tokens or a stop token; the row
    ends exactly there (tokens after it dropped), as without speculation."""
    prompts = _prompts(4, seed=4)
    oracle_joins = _joins(prompts, _greedy(max_tokens=12))
    oracle = _oracle(loaded, oracle_joins)
    joins = {0: [
        GenerationRequest("r0", tuple(prompts[0]), _greedy(max_tokens=6)),
        GenerationRequest("r1", tuple(prompts[1]), _greedy(max_tokens=7)),
        GenerationRequest("r2", tuple(prompts[2]), _greedy(stop_token_ids=(oracle["r2/0"][5],))),
        GenerationRequest("r3", tuple(prompts[3]), _greedy(stop_token_ids=(oracle["r3/0"][6],))),
    ]}  # fmt: skip
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    engine = LLMEngine(loaded, _spec())
    seen = force_drafts(engine, oracle, lambda row, r, k: k)  # never corrupted
    got = _drive(engine, joins)
    assert got == plain
    assert [len(got[(f"r{i}", 0)]) for i in range(4)] == [6, 7, 6, 7]
    assert seen == {K}


@pytest.mark.parametrize("chained", [False, True], ids=["lockstep", "chained"])
def test_thinking_budget_rows_speculate_around_their_forced_close(
    loaded: LoadedModel, chained: bool
) -> None:
    """Rows with a thinking budget draft (every draft right) except in steps whose k + 1
    tokens could reach the forced close: their output, the forced "\n</think>\n\n"
    included at the budget, is the plain engine's, and they did speculate before and
    after it (budgets 3 and 7 put the close at different offsets of a verify run).
    Chained (pipeline_verify; budgets 15 and 19, room to chain before the close), a
    verify is chained only where the tokens still in flight could not reach it."""
    prompts = _prompts(2, seed=6)
    close = (198, 151668, 271)
    budgets, max_tokens = ((15, 19), 40) if chained else ((3, 7), 16)

    def params(budget: int, max_tokens: int = max_tokens) -> SamplingParams:
        return _greedy(
            max_tokens=max_tokens, max_thinking_tokens=budget, thinking_close_ids=close,
            thinking_end_id=close[1],
        )  # fmt: skip

    joins = {0: [GenerationRequest(f"r{i}", tuple(p), params(budgets[i]))
                 for i, p in enumerate(prompts)]}  # fmt: skip
    longer = {0: [dataclasses.replace(r, params=params(r.params.max_thinking_tokens,
                                                        max_tokens + K + 1))
                  for r in joins[0]]}  # fmt: skip
    plain_engine = LLMEngine(loaded, SMALL)
    oracle = {f"{rid}/{i}": t for (rid, i), t in _drive(plain_engine, longer).items()}
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    for i, budget in enumerate(budgets):
        assert tuple(plain[(f"r{i}", 0)][budget : budget + 3]) == close  # forced there
    engine = LLMEngine(loaded, _spec(_chaining(SMALL) if chained else SMALL))
    counts = _count_chained(engine)
    seen = force_drafts(engine, oracle, lambda row, r, k: k)  # never corrupted
    assert _drive(engine, joins) == plain
    assert seen == {K} and engine.speculation.stats.num_drafted >= 4 * K
    assert bool(counts) == chained


def test_forcing_window_of_a_verify() -> None:
    """may_force_within: whether the next `count` tokens reach the forced close (budget
    4, a 3-token close: output indices 4, 5 and 6), unless `</think>` came in time."""
    p = SamplingParams(max_thinking_tokens=4, thinking_close_ids=(7, 8, 9), thinking_end_id=8)
    assert not p.may_force_within([1, 2], 2)  # writes indices 2, 3
    assert p.may_force_within([1, 2], 3)  # ... and 4
    assert p.may_force_within([1, 2, 3, 4, 7, 8], 3)  # index 6 is the close's last
    assert not p.may_force_within([1, 2, 3, 4, 7, 8, 9], 3)  # closed: free again
    assert not p.may_force_within([1, 8, 3], 3)  # the model closed within the budget
    assert not SamplingParams().may_force_within([], 100)


@pytest.mark.parametrize("chained", [False, True], ids=["lockstep", "chained"])
def test_logprobs_per_accepted_token(loaded: LoadedModel, chained: bool) -> None:
    """Each accepted token carries its own logprob and top logprobs, as without; also
    where verify steps are chained (pipeline_verify), their logprobs lazy like the rest."""
    prompts = _prompts(3, seed=5)
    params = _greedy(max_tokens=32, logprobs=True, top_logprobs=2)
    plain = LLMEngine(loaded, SMALL).generate(prompts, params)
    engine = LLMEngine(loaded, _spec(_chaining(SMALL) if chained else SMALL))
    counts = _count_chained(engine)
    oracle = {f"gen-{i}/0": c.token_ids + [0] * (K + 1) for i, c in enumerate(plain)}
    force_drafts(engine, oracle, _cycle)
    got = engine.generate(prompts, params)
    assert bool(counts) == chained
    for a, b in zip(got, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-3)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_n_choices_constrained_and_image_rows_in_a_speculating_batch(
    loaded: LoadedModel,
) -> None:
    """n > 1 choices each speculate from their own state, beside a constrained row, a
    logit_bias row and an image row (at its shifted rotary positions): all equal the
    engine without speculation, and batched equals alone."""
    prompts = _prompts(3, seed=6)
    pic = image(7)
    image_ids = prompt_with(loaded, [pic], 7)
    reqs = [
        GenerationRequest("n3", tuple(prompts[0]), _greedy(max_tokens=10), n=3),
        GenerationRequest(
            "json", tuple(prompts[1]), dataclasses.replace(
                _greedy(max_tokens=10), constraint=Constraint("json_object"), ignore_eos=False
            ),
        ),
        GenerationRequest("img", tuple(image_ids), _greedy(max_tokens=10), images=(pic,)),
        GenerationRequest(
            "biased", tuple(prompts[2]), _greedy(max_tokens=8, logit_bias={5: -1.0})
        ),
    ]  # fmt: skip
    joins = {0: reqs[:2], 2: reqs[2:]}
    plain = _drive(LLMEngine(loaded, SMALL), joins)
    engine = LLMEngine(loaded, _spec())
    oracle = _oracle(loaded, joins)
    seen = force_drafts(engine, oracle, _cycle)
    got = _drive(engine, joins)
    assert got == plain
    assert got[("n3", 0)] == got[("n3", 1)] == got[("n3", 2)]
    assert len(seen) > 1
    alone = LLMEngine(loaded, _spec())
    force_drafts(alone, oracle, _cycle)
    assert _drive(alone, {0: [reqs[2]]})[("img", 0)] == got[("img", 0)]


def test_rows_with_penalties_and_bias_speculate_as_they_sample(loaded: LoadedModel) -> None:
    """Rows with presence / frequency / repetition penalties and logit_bias draft, each
    verify column processed with the drafts before it as output: greedy and seeded
    sampled rows write their text without speculation (every accepted count 0..k, with
    forced drafts), with the same logprobs."""
    prompts = _prompts(4, seed=14)
    # Each row's bias makes the runner-up of its first step win (these logits span ~100)
    # until a penalty over the tokens before each column (drafts included) stops it
    # repeating: the processing changes the text, column by column.
    top = [lp.top for lp in (_logprobs_of(LLMEngine(loaded, SMALL), [GenerationRequest(
        f"t{i}", tuple(p), _greedy(max_tokens=1, logprobs=True, top_logprobs=2))])[0]
        for i, p in enumerate(prompts))]  # fmt: skip
    runner_up = [t[1][0] for t in top]
    penalised = [
        _greedy(max_tokens=14, logit_bias={runner_up[0]: 100.0}, repetition_penalty=1.5,
                presence_penalty=2.0, frequency_penalty=2.0, logprobs=True, top_logprobs=2),
        _greedy(max_tokens=14, logit_bias={runner_up[1]: 100.0}, repetition_penalty=1.5),
        _greedy(max_tokens=14, logit_bias={runner_up[2]: 100.0, top[2][0][0]: -100.0},
                repetition_penalty=1.5),
        _sampled(max_tokens=14, seed=3, logit_bias={runner_up[3]: 100.0},
                 repetition_penalty=1.5),
    ]  # fmt: skip
    reqs = [
        GenerationRequest(f"r{i}", tuple(p), params)
        for i, (p, params) in enumerate(zip(prompts, penalised, strict=True))
    ]
    joins = {0: reqs[:2], 1: reqs[2:]}
    oracle = _oracle(loaded, joins)
    want = _drive(LLMEngine(loaded, SMALL), joins)
    for i, token in enumerate(runner_up):  # the bias wins, the penalty stops it
        text = want[(f"r{i}", 0)]
        assert text[0] == token and text.count(token) < len(text) / 2, (token, text)
    engine = LLMEngine(loaded, _spec())
    seen = force_drafts(engine, oracle, _cycle)
    assert _drive(engine, joins) == want
    assert seen == set(range(K + 1)), seen
    speculating = LLMEngine(loaded, _spec())
    force_drafts(speculating, oracle, _cycle)
    got_lp = _logprobs_of(speculating, reqs[:1])
    want_lp = _logprobs_of(LLMEngine(loaded, SMALL), reqs[:1])
    assert [lp.token_id for lp in got_lp] == [lp.token_id for lp in want_lp]
    for a, b in zip(got_lp, want_lp, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_constrained_rows_speculate_under_their_grammar(loaded: LoadedModel) -> None:
    """Rows with a grammar draft, each verify column masked by the grammar after the
    drafts before it (RowConstraints.verify_masks): greedy JSON, a regex, a row whose
    grammar starts after a token it drafts, and a seeded sampled JSON row write their
    text without speculation, with forced drafts (the true continuations, some
    corrupted, which the grammar or the model then refuses), and they all verified."""
    prompts = _prompts(4, seed=15)
    free = LLMEngine(loaded, SMALL).generate([prompts[2]], _greedy(max_tokens=6))[0]
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 12, "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "integer"}, "minItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    grammars = [
        Constraint("json_schema", schema=schema),
        Constraint("regex", grammar=r"[a-z]{4,12}( [a-z]{4,12}){4,8}"),
        Constraint("json_schema", schema=schema, start_after_token_id=free.token_ids[2]),
        Constraint("json_schema", schema=schema),
    ]
    params = [_greedy(max_tokens=24)] * 3 + [_sampled(max_tokens=24, seed=5)]
    reqs = [
        GenerationRequest(f"r{i}", tuple(prompt), dataclasses.replace(
            p, constraint=grammar, ignore_eos=False))
        for i, (prompt, p, grammar) in enumerate(zip(prompts, params, grammars, strict=True))
    ]  # fmt: skip
    joins = {0: reqs[:2], 1: reqs[2:]}
    want = _drive(LLMEngine(loaded, SMALL), joins)
    assert all(len(text) > 8 for text in want.values()), want
    engine = LLMEngine(loaded, _spec())
    drafter = engine.runner.drafter
    assert drafter is not None
    draft, verified = drafter.draft, set()

    def recording(row_ids, state, last, rows):  # type: ignore[no-untyped-def]
        verified.update(row_ids)
        return draft(row_ids, state, last, rows)

    drafter.draft = recording  # type: ignore[method-assign]
    seen = force_drafts(engine, _oracle(loaded, joins), _cycle)
    assert _drive(engine, joins) == want
    assert verified == {f"r{i}/0" for i in range(4)} and len(seen) > 2, (verified, seen)
    assert not engine.constraints._rows  # every matcher released


def test_verify_columns_are_processed_with_the_drafts_before_them(loaded: LoadedModel) -> None:
    """The runner processes verify column j of a row with logit_bias and penalties as the
    plain sampler would with the row's first j drafts appended to its output."""
    runner = LLMEngine(loaded, _spec()).runner
    vocab = loaded.config.vocab_size
    logits = 10 * mx.random.normal((2, K + 1, vocab), key=mx.random.key(0))
    drafts = [[5, 6, 5], [7, 7, 8]]
    params = [
        _greedy(logit_bias={5: 2.0}, presence_penalty=1.5, frequency_penalty=0.7,
                repetition_penalty=1.3),
        _sampled(frequency_penalty=2.0),
    ]  # fmt: skip
    rows = [SamplingRow(params[0], (1, 2, 3), [5, 9]), SamplingRow(params[1], (4,), [])]
    step = VerifyStep(("a", "b"), mx.array(drafts), None, mx.zeros((2, K + 1, 8)), logits, (3, 1))
    got = runner._processed(step, rows).logits
    for b, row in enumerate(rows):
        for j in range(K + 1):
            seen = SamplingRow(row.params, row.prompt_ids, [*row.output_ids, *drafts[b][:j]])
            want = Sampler().process(logits[b : b + 1, j], [seen])[0]
            assert mx.allclose(got[b, j], want).item(), (b, j)
    plain = [SamplingRow(_greedy(), (1,), []), SamplingRow(_sampled(), (2,), [])]
    assert runner._processed(step, plain) is step  # nothing to process: as it came


def _logprobs_of(engine: LLMEngine, reqs: list[GenerationRequest]) -> list[TokenLogprob]:
    """The first request's logprobs, driving `reqs` to the end."""
    for req in reqs:
        engine.add_request(req)
    out: list[TokenLogprob] = []
    while engine.has_work():
        for delta in engine.step():
            if delta.request_id == reqs[0].request_id and delta.logprobs:
                out += delta.logprobs
    return out


def test_speculation_without_a_head_warns_and_runs_plainly(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """speculative=mtp on a model without an MTP head: a warning, and plain decoding."""
    headless = dataclasses.replace(loaded, mtp=None)
    with caplog.at_level("WARNING"):
        engine = LLMEngine(headless, _spec())
    assert engine.speculation is None and "no MTP head" in caplog.text
    prompts = _prompts(2, seed=8)
    assert [c.token_ids for c in engine.generate(prompts, _greedy())] == [
        c.token_ids for c in LLMEngine(loaded, SMALL).generate(prompts, _greedy())
    ]


def _sampled(max_tokens: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_seeded_sampled_rows_write_their_text_without_speculation(
    loaded: LoadedModel,
) -> None:
    """Seeded sampled rows (top_p, top_k, min_p, n = 2) draft with the head and write
    exactly what they write without speculation (their draws coupled to the plain
    sampler's noise), so run to run and alone as beside greedy rows too."""
    prompts = _prompts(4, seed=9)
    seeded = GenerationRequest("seeded", tuple(prompts[0]), _sampled(max_tokens=14, seed=5))
    others = [
        GenerationRequest("g", tuple(prompts[1]), _greedy(max_tokens=10)),
        GenerationRequest("s", tuple(prompts[2]), _sampled(top_k=20, seed=1)),
        GenerationRequest("n2", tuple(prompts[3]), _sampled(min_p=0.1, seed=3), n=2),
    ]
    joins = {0: [seeded, others[0]], 1: others[1:]}
    engine = LLMEngine(loaded, _spec())
    first = _drive(engine, joins)
    assert engine.scheduler.rows == {} and engine.speculation.stats.num_drafted > 0
    assert first == _drive(LLMEngine(loaded, SMALL), joins)
    assert _drive(LLMEngine(loaded, _spec()), joins) == first
    compiled = _spec(dataclasses.replace(SMALL, compile_decode=True))  # bucketed verifies
    assert _drive(LLMEngine(loaded, compiled), joins) == first
    alone = LLMEngine(loaded, _spec())
    assert _drive(alone, {0: [seeded]}) == {("seeded", 0): first[("seeded", 0)]}
    assert alone.speculation.stats.num_drafted > 0
    assert len(first[("seeded", 0)]) == 14 and first[("n2", 0)] != first[("n2", 1)]


def test_forced_drafts_at_temperature_keep_max_tokens_and_stop_tokens_exact(
    loaded: LoadedModel,
) -> None:
    """temperature > 0 rows with certain (forced) drafts: min_p 1 keeps only the argmax,
    so speculative sampling must reproduce the greedy tokens and their logprobs with
    every count 0..k accepted; at plain temperature the counts vary and runs end exactly
    at max_tokens or at a stop token inside an accepted run."""
    prompts = _prompts(4, seed=10)
    oracle = _oracle(loaded, _joins(prompts, _greedy(max_tokens=16)))
    argmax = _sampled(max_tokens=16, min_p=1.0, seed=4, logprobs=True, top_logprobs=2)
    joins = _joins(prompts, argmax)
    plain = LLMEngine(loaded, SMALL).generate(prompts, argmax)
    engine = LLMEngine(loaded, _spec())
    seen = force_drafts(engine, {f"gen-{i}/0": oracle[f"r{i}/0"] for i in range(4)}, _cycle)
    got = engine.generate(prompts, argmax)
    assert seen == set(range(K + 1)), seen
    for i, (a, b) in enumerate(zip(got, plain, strict=True)):
        assert a.token_ids == b.token_ids == oracle[f"r{i}/0"][:16]
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-3)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert _drive(LLMEngine(loaded, SMALL), joins) == {
        (f"r{i}", 0): c.token_ids for i, c in enumerate(plain)
    }
    warm = {0: [GenerationRequest(f"r{i}", tuple(p), _sampled(max_tokens=5 + i, seed=i))
                for i, p in enumerate(prompts)]}  # fmt: skip
    engine = LLMEngine(loaded, _spec())
    seen = force_drafts(engine, oracle, _cycle)
    got = _drive(engine, warm)
    assert len(seen) > 1, seen
    assert [len(got[(f"r{i}", 0)]) for i in range(4)] == [5, 6, 7, 8]
    stop = got[("r3", 0)][4]
    cut = got[("r3", 0)].index(stop) + 1
    params = dataclasses.replace(warm[0][3].params, stop_token_ids=(stop,), ignore_eos=False)
    engine = LLMEngine(loaded, _spec())
    force_drafts(engine, oracle, _cycle)
    again = _drive(engine, {0: [dataclasses.replace(warm[0][3], params=params)]})
    assert again == {("r3", 0): got[("r3", 0)][:cut]}


@pytest.mark.parametrize("chained", [False, True], ids=["lockstep", "chained"])
def test_a_speculating_row_reserves_the_heads_kv(loaded: LoadedModel, chained: bool) -> None:
    """The MTP head's KV (one full-precision layer per token) is in a speculating row's
    budget share, and not in a row that cannot speculate. Where verify steps are chained,
    a speculating row's rejected drafts stay as left padding (trunk and head) until every
    row of its store has COMPACT_PAD of them: its share counts those columns too."""
    engine = LLMEngine(loaded, _chaining(_spec()) if chained else _spec())
    cfg, costs = loaded.config, engine.budget.costs
    assert costs.draft_kv_bytes_per_token == 2 * cfg.num_key_value_heads * cfg.head_dim * (
        loaded.dtype.size
    )
    pad = kv_module.COMPACT_PAD + K + 1 if chained else 0
    assert engine.budget.draft_pad_columns == pad
    prompts = _prompts(2, seed=11)
    engine.add_request(GenerationRequest("spec", tuple(prompts[0]), _sampled(max_tokens=9)))
    engine.add_request(
        GenerationRequest("plain", tuple(prompts[1]), _greedy(max_tokens=9, speculative=False))
    )
    engine.step()
    rows = {r.request_id: r for r in engine.scheduler.rows.values()}
    spec, plain = rows["spec"], rows["plain"]
    assert spec.speculative and not plain.speculative
    per_token = costs.kv_bytes_per_token + costs.draft_kv_bytes_per_token
    columns = spec.max_total_tokens() + pad
    assert spec.reserved_bytes == costs.ssm_bytes_per_row + columns * per_token
    plain_bytes = costs.ssm_bytes_per_row + plain.max_total_tokens() * costs.kv_bytes_per_token
    assert plain.reserved_bytes == plain_bytes
