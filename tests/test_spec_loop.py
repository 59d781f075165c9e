"""Greedy speculative decoding at the model level (no engine): draft with the MTP head ->
verify every row's k + 1 tokens in one forward -> accept -> roll back, in a loop, yields
exactly the plain greedy tokens, for one row and for a batch of rows of different lengths.

Random weights make the MTP head's drafts almost never right, so a second draft source
forces partial acceptance: the row's own greedy continuation with some tokens corrupted,
which makes every count 0..k happen. The loop below is the integration's recipe in
miniature: what the engine will do per decode step.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import pytest
from parity_utils import long_ids
from spec_utils import plain_greedy, prefill, run

from deltaserve.engine.cache.kv import FullPrecisionKV
from deltaserve.engine.sampling.speculative import accept_greedy
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.mtp import draft
from deltaserve.models.state import text_positions
from deltaserve.models.testing import cached_checkpoint

STEPS = 12
# (row, tokens emitted so far, the MTP head's drafts [k]) -> the drafts to verify
DraftSource = Callable[[int, int, list[int]], list[int]]


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


def _right_aligned(parts: list[mx.array]) -> tuple[mx.array, tuple[int, ...]]:
    """Rows [n_b, ...] left-padded to one [B, max n, ...] array, and the pads."""
    width = max(p.shape[0] for p in parts)
    pads = tuple(width - p.shape[0] for p in parts)
    rows = [
        mx.pad(p, [(pad, 0)] + [(0, 0)] * (p.ndim - 1)) for p, pad in zip(parts, pads, strict=True)
    ]
    return mx.stack(rows), pads


def speculative_greedy(
    loaded: LoadedModel, prompts: list[list[int]], k: int, source: DraftSource | None = None
) -> tuple[list[list[int]], set[int]]:
    """STEPS greedy tokens per row with speculation; also the accepted counts seen."""
    model, head = loaded.model, loaded.mtp
    state, hidden = prefill(loaded, prompts)
    first = mx.argmax(model.logits(hidden[:, -1]), axis=-1).tolist()
    out = [[t] for t in first]
    # The head pairs each trunk hidden h_t with the token after it: the prompt's own
    # next tokens, then the first sampled one.
    pair_hidden = [hidden[b, hidden.shape[1] - len(p) :] for b, p in enumerate(prompts)]
    pair_tokens = [mx.array([*p[1:], out[b][0]]) for b, p in enumerate(prompts)]
    pair_start = [0] * len(prompts)
    head_kv, seen = FullPrecisionKV(), set()
    while min(len(o) for o in out) < STEPS:
        chunk_hidden, pads = _right_aligned(pair_hidden)
        chunk_tokens, _ = _right_aligned(pair_tokens)
        width = chunk_tokens.shape[1]
        positions = text_positions(
            [s + len(h) - width for s, h in zip(pair_start, pair_hidden, strict=True)], width
        )
        drafts = draft(model, head, chunk_hidden, chunk_tokens, positions, head_kv, k, pads or None)
        head_kv.rollback([k - 1] * len(prompts))  # the chained drafts' speculative pairs
        proposed = drafts.tokens.tolist()
        if source is not None:
            proposed = [source(b, len(out[b]), d) for b, d in enumerate(proposed)]
        offsets = [len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)]
        rows = [[o[-1], *d] for o, d in zip(out, proposed, strict=True)]
        verified = run(loaded, state, rows, offsets, state_slots=True)  # [B, k + 1, H]
        verdict = accept_greedy(model.logits(verified), mx.array(proposed, dtype=mx.int32))
        counts, nxt = verdict.num_accepted.tolist(), verdict.next_token.tolist()
        seen.update(counts)
        state.keep_verified([a + 1 for a in counts], k + 1)
        for b, a in enumerate(counts):
            new = [*proposed[b][:a], nxt[b]]
            out[b] += new
            pair_hidden[b] = verified[b, : a + 1]
            pair_tokens[b] = mx.array(new)
            pair_start[b] = offsets[b]
    return [o[:STEPS] for o in out], seen


def _prompts(lengths: list[int]) -> list[list[int]]:
    ids = long_ids(max(lengths) + 40)
    return [ids[40 - n % 40 : 40 - n % 40 + n] for n in lengths]


@pytest.mark.parametrize("lengths", [[23], [30, 19, 7]])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_keep_greedy_output(loaded: LoadedModel, lengths: list[int], k: int) -> None:
    """Drafting with the MTP head changes no token of greedy output."""
    prompts = _prompts(lengths)
    got, _ = speculative_greedy(loaded, prompts, k)
    assert got == [plain_greedy(loaded, p, STEPS) for p in prompts]


@pytest.mark.parametrize("k", [2, 3])
def test_partial_acceptance_keeps_greedy_output(loaded: LoadedModel, k: int) -> None:
    """Drafts from the true continuation with some tokens corrupted: rows accept 0..k
    drafts (each count happens), rows disagree on counts, output stays exact."""
    prompts = _prompts([30, 19, 7])
    oracle = [plain_greedy(loaded, p, STEPS + k + 1) for p in prompts]

    calls = [0] * len(prompts)

    def source(row: int, emitted: int, _: list[int]) -> list[int]:
        # Round r corrupts draft (r + row) % (k + 1) of the row (index k: none), so the
        # rows of one round accept different counts and each count comes round.
        wrong = (calls[row] + row) % (k + 1)
        calls[row] += 1
        true = oracle[row][emitted : emitted + k]
        return [t + 1 if i == wrong else t for i, t in enumerate(true)]

    got, seen = speculative_greedy(loaded, prompts, k, source)
    assert got == [o[:STEPS] for o in oracle]
    assert seen == set(range(k + 1)), seen
