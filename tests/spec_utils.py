"""Helpers of the speculative-decoding tests: model-level forwards of equal-length rows
through a BatchState (no engine), the MTP head's own KV store, and prompts."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import FullPrecisionKV, KVStore
from deltaserve.models.build import LoadedModel
from deltaserve.models.state import ForwardGroup, text_positions


def run(
    loaded: LoadedModel,
    state: BatchState,
    rows: Sequence[Sequence[int]],
    offsets: Sequence[int],
    left_pad: tuple[int, ...] | None = None,
    state_slots: bool = False,
) -> mx.array:
    """One forward of equal-length `rows` (already left-padded); offsets[b] is the
    position of row b's column 0. Returns the final-normed hidden [B, L, H]."""
    tokens = mx.array([list(r) for r in rows], dtype=mx.int32)
    positions = text_positions(list(offsets), tokens.shape[1])
    group = ForwardGroup(tokens, positions, state.layers, left_pad, state_slots=state_slots)
    (hidden,) = loaded.model([group])
    return hidden


def prefill(
    loaded: LoadedModel, prompts: Sequence[Sequence[int]], kv_factory: type[KVStore] | None = None
) -> tuple[BatchState, mx.array]:
    """Left-padded prefill of `prompts` in one batch: (state, hidden [B, L, H]).
    Row b's column j holds token j - pad[b] of its prompt."""
    width = max(len(p) for p in prompts)
    pads = tuple(width - len(p) for p in prompts)
    rows = [[0] * pad + list(p) for pad, p in zip(pads, prompts, strict=True)]
    state = BatchState.empty(loaded.config, kv_factory or FullPrecisionKV)
    hidden = run(loaded, state, rows, [-pad for pad in pads], pads)
    return state, hidden


def greedy_tokens(loaded: LoadedModel, hidden: mx.array) -> list[list[int]]:
    """Argmax token ids [B][L] of hidden [B, L, H]."""
    return mx.argmax(loaded.model.logits(hidden), axis=-1).tolist()


def plain_greedy(loaded: LoadedModel, prompt: Sequence[int], steps: int) -> list[int]:
    """`steps` greedy tokens of one row, one decode token at a time (the oracle)."""
    state, hidden = prefill(loaded, [prompt])
    out = [greedy_tokens(loaded, hidden[:, -1:])[0][0]]
    for _ in range(steps - 1):
        hidden = run(loaded, state, [[out[-1]]], [len(prompt) + len(out) - 1])
        out.append(greedy_tokens(loaded, hidden)[0][0])
    return out
