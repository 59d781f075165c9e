"""Speculative decoding with the MTP head, on the worker: draft, verify, accept, roll back.

A speculating row's step (the scheduler puts it in StepPlan.verify_row_ids): the head
drafts k tokens from the trunk hidden states the row produced since its last draft
(`Drafter.draft`); the trunk runs the row's last token and the k drafts as one
[B, k + 1] verify group with ForwardGroup.state_slots; the row keeps its last token and
the leading drafts that equal the trunk's argmax, plus the argmax after them
(sampling/speculative.py's accept_greedy), so greedy output equals plain decoding token
for token. `BatchState.keep_verified` then forgets the rejected columns (KV) and takes
the DeltaNet state after the last kept one: no forward is replayed.

The head pairs each trunk hidden h_t with the token x_{t+1} after it (models/mtp.py).
Its KV store (BatchState.draft) gets every prompt pair at prefill (`prompt_pairs`), and
after each verify the a + 1 kept pairs, at the next draft. Pairs not stored yet wait
here (`_Pairs`); a row that decoded without speculating has none (its head store then
misses those positions, which only makes its drafts worse, never its output wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore
from deltaserve.engine.plan import VerifiedRun
from deltaserve.engine.sampling.sampler import top_sorted
from deltaserve.engine.sampling.speculative import accept_greedy
from deltaserve.engine.types import SamplingParams, TokenLogprob
from deltaserve.models.mtp import MTPHead, draft
from deltaserve.models.qwen35 import Qwen35Model


@dataclass
class _Pairs:
    """A row's trunk hidden states not yet paired in the head's store."""

    hidden: mx.array  # [n, H]
    positions: mx.array  # [3, n] int32: the hidden's rotary positions
    tokens: mx.array | None  # [n] int32: the token after each (None: the last one is the
    # first token sampled from a prompt, known at read-back)


@dataclass(frozen=True)
class VerifyStep:
    """A verify group's outputs, queued (lazy). Written by the runner's execute."""

    row_ids: tuple[str, ...]
    drafts: mx.array  # [B, k] int32: the drafts the rows ran
    hidden: mx.array  # [B, k + 1, H]: the trunk's final-normed hidden at each input
    logits: mx.array  # [B, k + 1, V]
    positions: tuple[int, ...]  # each row's first input position


@dataclass(frozen=True)
class Verdicts:
    """A verify step's acceptance, queued (lazy). Written by Drafter.accept."""

    step: VerifyStep
    num_accepted: mx.array  # [B] int32
    tokens: mx.array  # [B, k + 1] int32: the row's emitted tokens (its first a + 1)
    logprobs: mx.array | None  # [B, k + 1] float32 of those tokens (None: nobody asked)
    top_ids: mx.array | None  # [B, k + 1, K] int32, best first
    top_logprobs: mx.array | None  # [B, k + 1, K] float32

    def arrays(self) -> list[mx.array]:
        """The arrays to evaluate (mx.async_eval)."""
        out = [self.num_accepted, self.tokens, self.logprobs, self.top_ids, self.top_logprobs]
        return [a for a in out if a is not None]


class Drafter:
    """The MTP head's drafting for the rows that speculate, and its pending pairs."""

    def __init__(self, model: Qwen35Model, head: MTPHead, num_draft: int) -> None:
        self.model = model
        self.head = head
        self.num_draft = num_draft
        self._pending: dict[str, _Pairs] = {}

    # -- rows -----------------------------------------------------------------------------
    def forget(self, row_ids: Sequence[str]) -> None:
        """Freed rows, or rows that decode without speculating (their pairs go stale)."""
        for row_id in row_ids:
            self._pending.pop(row_id, None)

    def fork(self, child: str, parent: str) -> None:
        """A fork's first token was sampled with its parent's: it starts from its pairs."""
        pairs = self._pending.get(parent)
        if pairs is not None and child not in self._pending:
            self._pending[child] = _Pairs(pairs.hidden, pairs.positions, pairs.tokens)

    def clear(self) -> None:
        self._pending.clear()

    # -- prompts --------------------------------------------------------------------------
    def prompt_pairs(
        self,
        state: BatchState,
        hidden: mx.array,
        positions: mx.array,
        next_ids: Sequence[int],
        sample_row_ids: Sequence[str],
    ) -> None:
        """After a prompt chunk of one row: hidden [L, H] and positions [3, L] of its
        columns, next_ids the prompt token after each (L - 1 of them when the chunk ends
        the prompt: the last pairs with the token the rows in sample_row_ids draw). The
        known pairs go to the row's head store; the last one, if pending, waits here."""
        store = state.aligned_draft()
        assert store is not None, "a speculating row's state has a head store"
        known = len(next_ids)
        if known:
            tokens = mx.array(list(next_ids), dtype=mx.int32)[None]
            embeds = self.model.embed_tokens(tokens)
            # only the pairs' K/V are needed: the head computes its last output alone
            self.head(embeds, hidden[None, :known], positions[:, None, :known], store,
                      last_only=True)  # fmt: skip
        for row_id in sample_row_ids:
            self._pending[row_id] = _Pairs(hidden[known:], positions[:, known:], None)

    def sampled(self, row_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """First tokens read back: they complete their rows' pending pairs."""
        for row_id, token in zip(row_ids, tokens, strict=True):
            pairs = self._pending.get(row_id)
            if pairs is not None and pairs.tokens is None:
                pairs.tokens = mx.array([token], dtype=mx.int32)

    # -- a verify step --------------------------------------------------------------------
    def draft(self, row_ids: Sequence[str], state: BatchState, last: mx.array) -> mx.array:
        """Drafts [B, k] int32 of the verify batch's rows (`last` [B] their last tokens):
        each row's pending pairs go into its head store, right-aligned, then the head
        chains k drafts; its k - 1 speculative pairs are rolled back at once. A row with
        no pairs (it decoded without speculating) drafts from its store alone."""
        k, store = self.num_draft, state.aligned_draft()
        assert store is not None, "the verify batch has a head store"
        pairs = [self._pending.pop(r, None) for r in row_ids]
        pairs = [p if p is not None and p.tokens is not None else None for p in pairs]
        if all(p is None for p in pairs):
            return mx.repeat(last[:, None], k, axis=1)  # nothing to draft from yet
        width = max(int(p.hidden.shape[0]) for p in pairs if p is not None)
        template = next(p for p in pairs if p is not None)
        hidden, tokens, positions, pads = [], [], [], []
        for p in pairs:
            n = int(p.hidden.shape[0]) if p is not None else 0
            pad = width - n
            pads.append(pad)
            if p is None:
                hidden.append(mx.zeros((width, template.hidden.shape[1]), template.hidden.dtype))
                tokens.append(mx.zeros((width,), mx.int32))
                positions.append(mx.zeros((3, width), mx.int32))
                continue
            hidden.append(mx.pad(p.hidden, [(pad, 0), (0, 0)]))
            tokens.append(mx.pad(p.tokens, [(pad, 0)]))
            positions.append(mx.pad(p.positions, [(0, 0), (pad, 0)]))
        drafts = draft(
            self.model,
            self.head,
            mx.stack(hidden),
            mx.stack(tokens),
            mx.stack(positions, axis=1),
            store,
            k,
            tuple(pads) if any(pads) else None,
        )
        if k > 1:
            store.rollback([k - 1] * len(row_ids))
        return drafts.tokens

    def accept(self, step: VerifyStep, params: Sequence[SamplingParams]) -> Verdicts:
        """Each row's accepted drafts and next token (greedy rows: accept_greedy), with
        logprobs of the emitted tokens for rows that ask (queued, lazy)."""
        k = step.drafts.shape[1]
        verdict = accept_greedy(step.logits, step.drafts)
        column = mx.arange(k + 1, dtype=mx.int32)[None]
        count = verdict.num_accepted[:, None]
        padded = mx.concatenate([step.drafts, verdict.next_token[:, None]], axis=1)
        tokens = mx.where(column < count, padded, verdict.next_token[:, None])
        top = max((p.top_logprobs for p in params if p.logprobs), default=0)
        if not any(p.logprobs for p in params):
            return Verdicts(step, verdict.num_accepted, tokens, None, None, None)
        z = step.logits.astype(mx.float32)
        lse = mx.logsumexp(z, axis=-1, keepdims=True)
        token_lp = (mx.take_along_axis(z, tokens[..., None], axis=-1) - lse)[..., 0]
        top_ids = top_lps = None
        if top:
            b, length, vocab = z.shape
            ids, vals = top_sorted(z.reshape(b * length, vocab), top)
            top_ids = ids.reshape(b, length, top).astype(mx.int32)
            top_lps = vals.reshape(b, length, top) - lse
        return Verdicts(step, verdict.num_accepted, tokens, token_lp, top_ids, top_lps)

    def read_back(
        self, verdicts: Verdicts, state: BatchState, params: Sequence[SamplingParams]
    ) -> list[VerifiedRun]:
        """Wait for the verdicts; roll the verify batch back to each row's kept columns;
        the kept columns' hidden states become the rows' pending pairs."""
        step, k = verdicts.step, verdicts.step.drafts.shape[1]
        counts = verdicts.num_accepted.tolist()
        tokens = verdicts.tokens.tolist()
        state.keep_verified([a + 1 for a in counts], k + 1)
        lps = verdicts.logprobs.tolist() if verdicts.logprobs is not None else None
        ids = verdicts.top_ids.tolist() if verdicts.top_ids is not None else None
        vals = verdicts.top_logprobs.tolist() if verdicts.top_logprobs is not None else None
        runs = []
        for b, (row_id, a) in enumerate(zip(step.row_ids, counts, strict=True)):
            emitted = tuple(tokens[b][: a + 1])
            first = step.positions[b]
            positions = mx.broadcast_to(mx.arange(first, first + a + 1, dtype=mx.int32), (3, a + 1))
            self._pending[row_id] = _Pairs(
                step.hidden[b, : a + 1], positions, mx.array(emitted, dtype=mx.int32)
            )
            logprobs: list[TokenLogprob | None] = [None] * len(emitted)
            if lps is not None and params[b].logprobs:
                n = params[b].top_logprobs
                logprobs = [
                    TokenLogprob(
                        t,
                        lps[b][i],
                        tuple(zip(ids[b][i][:n], vals[b][i][:n], strict=True)) if ids else (),
                    )
                    for i, t in enumerate(emitted)
                ]
            runs.append(VerifiedRun(row_id, emitted, tuple(logprobs), k))
        return runs


def store_arrays(state: BatchState) -> list[mx.array]:
    """The verify batch's arrays after a step (its head store's too), to evaluate."""
    store: KVStore | None = state.draft
    head = store.state_arrays() if store is not None else []
    return [a for layer in state.layers for a in layer.state_arrays()] + head
