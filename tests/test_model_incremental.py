"""Our model alone: how the input is split into steps and rows never changes the logits.

Each test compares a split computation (prefill + one-token decode, uneven prefill
chunks, left-padded batches, merged row states) with the same tokens in one full
forward of one row. Dense and MoE checkpoints; the DeltaNet layers run the chunked
kernel for L > 1 and the single-step kernel for L == 1, so these also pin the two
kernels, the conv tail and the KV store to each other inside the real model.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from parity_utils import forward, full_logits, long_ids, rel_error

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint

# Relative logit error bound, max|split - full| / max|full| (logits up to ~140). The
# split runs do the same float32 math in another order (chunk boundaries, step kernel vs
# chunked WY form, batch shapes); measured 1.5e-6 .. 5.9e-6 here (worst: 96 one-token
# decode steps). 5e-5 is a ~10x margin, while a real state bug moves logits by O(1):
# zeroing the conv tails between chunks gives ~1.0, ignoring left_pad ~1.4, and a wrong
# row's rotary offset ~4e-2 (all measured).
REL_TOL = 5e-5
CHUNKS = (7, 64, 30, 1)  # uneven, one exactly one DeltaNet chunk, one single token
LENGTH = sum(CHUNKS)  # 102


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return long_ids(LENGTH)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, ids: list[int]) -> mx.array:
    """Logits [LENGTH, V] of the whole prompt in one forward from a fresh state."""
    return full_logits(loaded, ids)


def test_prefill_then_token_by_token_decode_equals_full_forward(
    loaded: LoadedModel, ids: list[int], reference: mx.array
) -> None:
    """Prefill 6 tokens, then decode the other 96 one at a time: every position's logits."""
    prefill = 6
    state = BatchState.empty(loaded.config)
    parts = [forward(loaded, state, [ids[:prefill]], [0])[0]]
    for pos in range(prefill, LENGTH):
        parts.append(forward(loaded, state, [[ids[pos]]], [pos])[0])
    assert rel_error(mx.concatenate(parts, axis=0), reference) <= REL_TOL


def test_chunked_prefill_equals_full_forward(
    loaded: LoadedModel, ids: list[int], reference: mx.array
) -> None:
    """Prefill in chunks of 7 + 64 + 30 + 1 tokens equals one 102-token forward."""
    state = BatchState.empty(loaded.config)
    parts, start = [], 0
    for size in CHUNKS:
        parts.append(forward(loaded, state, [ids[start : start + size]], [start])[0])
        start += size
    assert rel_error(mx.concatenate(parts, axis=0), reference) <= REL_TOL


def test_left_padded_batch_equals_rows_alone(loaded: LoadedModel, ids: list[int]) -> None:
    """Fresh rows of lengths 102/45/1/70, left-padded with junk into one [4, 102] group,
    then one decode step: each row's logits equal that row run alone."""
    rows = [ids, ids[10:55], ids[3:4], ids[::-1][:70]]
    pads = tuple(LENGTH - len(r) for r in rows)
    junk = [(7919 * (i + 1)) % 240000 for i in range(LENGTH)]  # real ids: pads must not leak
    padded = [junk[:p] + r for p, r in zip(pads, rows, strict=True)]
    nxt = [[ids[i]] for i in range(len(rows))]  # one more token per row

    state = BatchState.empty(loaded.config)
    batch = forward(loaded, state, padded, [-p for p in pads], left_pad=pads)
    step = forward(loaded, state, nxt, [len(r) for r in rows])

    for b, (pad, row) in enumerate(zip(pads, rows, strict=True)):
        alone = full_logits(loaded, row + nxt[b])
        assert rel_error(batch[b, pad:], alone[:-1]) <= REL_TOL, f"row {b} prefill"
        assert rel_error(step[b], alone[-1:]) <= REL_TOL, f"row {b} decode"


def test_merged_states_decode_equals_rows_alone(loaded: LoadedModel, ids: list[int]) -> None:
    """Three B=1 states prefilled to lengths 5/33/70, merged into B=3, decode two steps:
    each row's logits equal that row decoded alone."""
    rows = [ids[:5], ids[20:53], ids[32:102]]
    steps = [[ids[i], ids[i + 3]] for i in range(3)]  # two decode tokens per row

    merged = BatchState.empty(loaded.config)
    for row in rows:
        single = BatchState.empty(loaded.config)
        forward(loaded, single, [row], [0])
        merged.merge(single)
    assert merged.num_rows == 3

    batched = []
    for t in range(2):
        offsets = [len(r) + t for r in rows]
        batched.append(forward(loaded, merged, [[s[t]] for s in steps], offsets))

    for b, (row, toks) in enumerate(zip(rows, steps, strict=True)):
        alone_state = BatchState.empty(loaded.config)
        forward(loaded, alone_state, [row], [0])
        for t in range(2):
            alone = forward(loaded, alone_state, [[toks[t]]], [len(row) + t])[0]
            assert rel_error(batched[t][b], alone) <= REL_TOL, f"row {b} step {t}"


@pytest.mark.parametrize("pack", [False, True])
def test_groups_in_one_forward_equal_each_group_alone(
    loaded: LoadedModel, ids: list[int], pack: bool
) -> None:
    """A decode group [2, 1], a left-padded prefill group [2, 33] and a fresh [1, 7] in
    one forward (packed token-wise work or not): each group's logits equal the group run
    alone in its own forward."""

    def groups() -> list[ForwardGroup]:
        decode = BatchState.empty(loaded.config)
        for row in (ids[:5], ids[40:60]):
            single = BatchState.empty(loaded.config)
            forward(loaded, single, [row], [0])
            decode.merge(single)
        prompts = [ids[60:93], [11] * 21 + ids[3:15]]  # second row: 21 junk pads
        return [
            ForwardGroup(_ids([[ids[7]], [ids[9]]]), text_positions([5, 20], 1), decode.layers),
            ForwardGroup(
                _ids(prompts),
                text_positions([0, -21], 33),
                BatchState.empty(loaded.config).layers,
                (0, 21),
            ),  # fmt: skip
            ForwardGroup(
                _ids([ids[:7]]), text_positions([0], 7), BatchState.empty(loaded.config).layers
            ),
        ]

    model = loaded.model
    model.pack_token_wise = False
    alone = [model.logits(model([g])[0]) for g in groups()]
    model.pack_token_wise = pack
    try:
        together = [model.logits(h) for h in model(groups())]
    finally:
        model.pack_token_wise = False
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        if i == 1:  # the padded row's pad columns are junk in both
            a, t = mx.concatenate([a[0], a[1, 21:]]), mx.concatenate([t[0], t[1, 21:]])
        assert rel_error(t.reshape(-1, t.shape[-1]), a.reshape(-1, a.shape[-1])) <= REL_TOL, i


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("outputs", ["last", "none"])
def test_a_chunk_that_reads_less_output_keeps_its_states_and_last_logits(
    loaded: LoadedModel, ids: list[int], pack: bool, outputs: str
) -> None:
    """A prompt chunk next to a decode group (packed or not) whose output is read only at
    its last position (outputs="last") or not at all ("none"): its states equal those of
    the same chunk run for every output, "last" gives that run's last-position logits,
    "none" gives None, and the decode group's logits are unchanged."""
    model = loaded.model

    def run(wanted: str) -> tuple[list, list[mx.array]]:
        decode = BatchState.empty(loaded.config)
        forward(loaded, decode, [ids[:5]], [0])
        prompt = BatchState.empty(loaded.config)
        forward(loaded, prompt, [ids[10:40]], [0])
        groups = [
            ForwardGroup(_ids([[ids[5]]]), text_positions([5], 1), decode.layers),
            ForwardGroup(_ids([ids[40:73]]), text_positions([30], 33), prompt.layers,
                         outputs=wanted),
        ]  # fmt: skip
        model.pack_token_wise = pack
        try:
            hidden = model(groups)
        finally:
            model.pack_token_wise = False
        states = [a for layer in prompt.layers for a in layer.state_arrays()]
        mx.eval(states)
        return hidden, states

    full, full_states = run("all")
    lean, lean_states = run(outputs)
    if outputs == "none":
        assert lean[1] is None
    else:
        assert lean[1].shape == (1, 1, full[1].shape[-1])
        assert rel_error(model.logits(lean[1][:, -1]), model.logits(full[1][:, -1])) <= REL_TOL
    assert rel_error(model.logits(lean[0][:, -1]), model.logits(full[0][:, -1])) <= REL_TOL
    assert len(lean_states) == len(full_states)
    for i, (a, b) in enumerate(zip(lean_states, full_states, strict=True)):
        assert a.shape == b.shape, f"state array {i}"
        assert rel_error(a, b) <= REL_TOL, f"state array {i}"


def test_an_unknown_outputs_value_is_refused() -> None:
    """A typo would otherwise leave the group out of the last layer (its state unwritten)."""
    with pytest.raises(ValueError, match="outputs"):
        ForwardGroup(_ids([[1]]), text_positions([0], 1), [], outputs="first")  # type: ignore[arg-type]


def _ids(rows: list[list[int]]) -> mx.array:
    return mx.array(rows, dtype=mx.int32)


@pytest.mark.parametrize("pack", [False, True])
def test_split_forward_keeps_the_state_at_its_snapshot(
    loaded: LoadedModel, ids: list[int], reference: mx.array, pack: bool
) -> None:
    """A forward with snapshot_at=37 (a prefix-cache snapshot inside a chunk; next to a
    decode group, packed or not) gives the unsplit logits, and each DeltaNet layer's
    checkpoint equals the state after a forward of the first 37 tokens alone."""
    model, split = loaded.model, 37
    head = BatchState.empty(loaded.config)
    forward(loaded, head, [ids[:split]], [0])
    decode = BatchState.empty(loaded.config)
    forward(loaded, decode, [ids[:5]], [0])
    state = BatchState.empty(loaded.config)
    groups = [
        ForwardGroup(_ids([[ids[5]]]), text_positions([5], 1), decode.layers),
        ForwardGroup(_ids([ids]), text_positions([0], LENGTH), state.layers, snapshot_at=split),
    ]
    model.pack_token_wise = pack
    try:
        logits = model.logits(model(groups)[1])
    finally:
        model.pack_token_wise = False
    assert rel_error(logits[0], reference) <= REL_TOL
    recurrent = [
        (a, b) for a, b in zip(state.layers, head.layers, strict=True) if isinstance(a, SSMState)
    ]
    assert recurrent and all(a.checkpoint is not None for a, _ in recurrent)
    for got, want in recurrent:
        for x, y in zip(got.checkpoint, (want.conv, want.ssm), strict=True):
            assert mx.allclose(x, y, rtol=1e-4, atol=1e-5).item()
