"""Speculative decoding with the MTP head, on the worker: draft, verify, accept, roll back.

A speculating row's step (the scheduler puts it in StepPlan.verify_row_ids): the head
drafts k tokens from the trunk hidden states the row produced since its last draft
(`Drafter.draft`); the trunk runs the row's last token and the k drafts as one
[B, k + 1] verify group with ForwardGroup.state_slots; the row keeps its last token and
the drafts it accepts, plus one token after them. `BatchState.keep_verified` then
forgets the rejected columns (KV) and takes the DeltaNet state after the last kept one:
no forward is replayed.

Chained verifies (EngineConfig.pipeline_verify; StepPlan.verify_chained): a verify step
of the same greedy rows may be built and queued while the one before it computes, as a
pipelined decode step is. Nothing it needs is then known on the host: each row's last
token, its first position, the rollback (`BatchState.keep_verified_pending`: every KV row
shifted right by its own rejected count, so shapes stay what the host knows; the DeltaNet
slot picked by an array) and the head's pairs (`_VerifiedPairs` with lazy counts) all
come from the acceptance as arrays, and the compiled verify and draft chain take them as
such. Read back, the counts settle the host's left pads (`KVStore.settle`). On a GPU a
lockstep verify waits for the device after building its graph; chained, the next one's
building overlaps it.

Greedy rows draft the head's argmax and accept the leading drafts that equal the
trunk's argmax (sampling/speculative.py's accept_greedy), so greedy output equals plain
decoding token for token. "The trunk's" logits are the sampler's processed ones: a row
with logit_bias or penalties has verify column j processed as if its first j drafts were
output already (the runner's `_processed`), so every rule below sees what the plain
sampler would at that position.

Sampled rows draw each draft from q, the head's distribution under the row's own
temperature / top_k / top_p / min_p (sampling/warp.py, the sampler's transform), by
Gumbel-max. Unseeded rows accept with standard speculative sampling (accept_sampled)
against p, the verify logits under the same transform: each emitted token follows the
row's sampling distribution exactly, with the highest acceptance any exact rule has.
Seeded rows instead couple every draw to the plain sampler's: the token at output index
i is the Gumbel-max of p with the noise the plain sampler uses at i (the row's seeded
stream-0 key of i, sampling/noise.py), and draft j is the Gumbel-max of q with that same
noise, accepted when it equals that token (accept_greedy over the perturbed logits). So a
seeded row writes exactly its text without speculation, whichever steps speculate (the
scheduler's choice, which depends on timing), alone or batched; it accepts somewhat
less often than speculative sampling would (a draft lands when both Gumbel-max draws
agree).

The head pairs each trunk hidden h_t with the token x_{t+1} after it (models/mtp.py).
Its KV store (BatchState.draft) gets every prompt pair at prefill (`prompt_pairs`), and
after each verify the a + 1 kept pairs, at the next draft. Pairs not stored yet wait
here: a verify batch's as they came out of it (`_VerifiedPairs`: when the next verify
batch is the same rows, one gather right-aligns them all, instead of a few small ops per
row, each a kernel launch on a GPU), other rows' one by one (`_Pairs`); a row that
decoded without speculating has none (its head store then misses those positions, which
only makes its drafts worse, never its output wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore
from deltaserve.engine.decode import KVView
from deltaserve.engine.plan import VerifiedRun
from deltaserve.engine.sampling.noise import gumbel_noise, uniform_noise
from deltaserve.engine.sampling.sampler import SamplingRow, noise_keys, top_sorted
from deltaserve.engine.sampling.speculative import Verdict, accept_greedy, accept_sampled
from deltaserve.engine.sampling.warp import Warp, warp_logits, warp_probs
from deltaserve.engine.types import TokenLogprob
from deltaserve.models.mtp import Chooser, MTPHead, draft, greedy
from deltaserve.models.qwen35 import Qwen35Model


@dataclass
class _Pairs:
    """A row's trunk hidden states not yet paired in the head's store."""

    hidden: mx.array  # [n, H]
    positions: mx.array  # [3, n] int32: the hidden's rotary positions
    tokens: mx.array | None  # [n] int32: the token after each (None: the last one is the
    # first token sampled from a prompt, known at read-back)


@dataclass(frozen=True)
class _VerifiedPairs:
    """A verify batch's kept columns, still batched: row b's pairs are columns
    0 .. counts[b] - 1 of hidden and tokens. Until the verify is read back its counts
    (and a chained verify's positions) are lazy arrays: a verify chained onto it drafts
    from them before they are known (`aligned`); read back, they are host values."""

    row_ids: tuple[str, ...]
    hidden: mx.array  # [B, k + 1, H]: the verify's final-normed hidden states
    tokens: mx.array  # [B, k + 1] int32: the emitted tokens (each kept column's next)
    first: tuple[int, ...] | mx.array  # each row's first column's position ([B] int32)
    counts: tuple[int, ...] | mx.array  # kept columns per row (its accepted drafts + 1)

    def row(self, b: int) -> _Pairs:
        """Row b's pairs on their own (once read back)."""
        assert isinstance(self.counts, tuple) and isinstance(self.first, tuple), "lazy pairs"
        n, first = self.counts[b], self.first[b]
        positions = mx.broadcast_to(mx.arange(first, first + n, dtype=mx.int32), (3, n))
        return _Pairs(self.hidden[b, :n], positions, self.tokens[b, :n])

    def aligned(self) -> tuple[mx.array, mx.array, mx.array, list[int] | mx.array]:
        """Every row's pairs right-aligned to the longest (lazy counts: to all k + 1
        columns), by one gather each: hidden [B, W, H], tokens [B, W], positions
        [3, B, W] and each row's padding columns (which hold copies of its first pair,
        masked as padding by the head; a [B] int32 array where the counts are lazy)."""
        if isinstance(self.counts, tuple):
            width = max(self.counts)
            pads: list[int] | mx.array = [width - n for n in self.counts]
            shift = mx.array(pads, dtype=mx.int32)[:, None]
        else:
            width = self.hidden.shape[1]
            pads = width - self.counts
            shift = pads[:, None]
        source = mx.maximum(mx.arange(width, dtype=mx.int32)[None] - shift, 0)  # [B, W]
        hidden = mx.take_along_axis(self.hidden, source[..., None], axis=1)
        tokens = mx.take_along_axis(self.tokens, source, axis=1)
        first = self.first if isinstance(self.first, mx.array) else mx.array(self.first)
        first = first.astype(mx.int32)[:, None]
        positions = mx.broadcast_to((first + source)[None], (3, *source.shape))
        return hidden, tokens, positions, pads


@dataclass(frozen=True)
class DraftRound:
    """A verify batch's drafts (lazy). Written by Drafter.draft."""

    tokens: mx.array  # [B, k] int32
    # [B, k, V]: the head's logits each draft was drawn from (sampled rows drew from
    # them warped: their q); None: the drafts are certain (q one-hot on each)
    logits: mx.array | None

    def arrays(self) -> list[mx.array]:
        """The arrays to evaluate (mx.async_eval)."""
        return [self.tokens] if self.logits is None else [self.tokens, self.logits]


@dataclass(frozen=True)
class VerifyStep:
    """A verify group's outputs, queued (lazy). Written by the runner's execute."""

    row_ids: tuple[str, ...]
    drafts: mx.array  # [B, k] int32: the drafts the rows ran
    draft_logits: mx.array | None  # [B, k, V]: DraftRound.logits
    hidden: mx.array  # [B, k + 1, H]: the trunk's final-normed hidden at each input
    logits: mx.array  # [B, k + 1, V]
    # each row's first input position ([B] int32, lazy: a verify chained onto one that
    # was not read back yet)
    positions: tuple[int, ...] | mx.array


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


def chain_width(rows: int, width: int, columns: int) -> int:
    """The pairs a row the head's draft chain runs with, for `rows` rows (dead ones
    included) whose widest brings `width` and a verify of `columns` (k + 1, the most a
    row keeps): a batch of several rows runs at least `columns`, the others left-padded,
    so that its chain is one compiled shape per row bucket and head-store capacity, not
    one per width the drafts happened to land at, each a trace met at random that stalls
    every stream (bench/README.md). Its store grows by `columns` a step, a few columns
    more than the rows keep. A single row keeps its own width: its three shapes are few."""
    return max(width, columns) if rows > 1 else width


class CompiledDraft:
    """The head's greedy drafting chain (models/mtp.py's `draft`: a pass over the rows'
    pairs, then k - 1 passes over its own drafts) as one compiled call per shape (rows,
    pairs per row, the head store's capacity): on a GPU an eager head pass costs its op
    count, k of them a step. The store is a KVView inside the trace, so a row's uneven
    pairs shift its stored tokens as KVStore.store would; the k - 1 speculative pairs are
    written past the store's new size, which is their rollback."""

    def __init__(self, model: Qwen35Model, head: MTPHead, num_draft: int) -> None:
        self.model = model
        self.head = head
        self.num_draft = num_draft
        self._fn = mx.compile(self._chain)
        self._store: KVStore | None = None  # the store of the traced call
        # ((rows, pairs per row), the store's capacity) of each call so far: a new one
        # was traced by that call (the runner reports it with the step, so its one-off
        # cost is kept out of the step-cost model and the speculation's break-even)
        self.shapes: set[tuple] = set()

    @staticmethod
    def supports(store: KVStore, rows: Sequence[SamplingRow]) -> bool:
        """Greedy rows over a store that holds arrays (sampled rows' draws and draft
        logits take the eager chain)."""
        return store.arrays is not None and all(r.params.is_greedy for r in rows)

    def __call__(
        self,
        hidden: mx.array,
        tokens: mx.array,
        positions: mx.array,
        pads: Sequence[int] | mx.array,
        store: KVStore,
    ) -> mx.array:
        """The drafts [B, k] of right-aligned pairs (as `draft` takes them, pads[b]
        padding columns in row b); the store keeps the real pairs, as after `draft` and
        the rollback of its k - 1 speculative pairs. Lazy pads ([B] int32: a chained
        verify's) become the store's pending padding (KVStore.pending), which the
        drafter settles once they are read back."""
        width, k = hidden.shape[1], self.num_draft
        store.reserve(width + k - 1)
        size = store.size
        self.shapes.add((tuple(hidden.shape[:2]), store.capacity))
        # rows with stored tokens move them right over the padding; empty rows just pad
        if isinstance(pads, mx.array):
            assert store.pending is None, "the head store's last pads are not settled"
            old = mx.array(store.left_pad, dtype=mx.int32)
            moved, left_pad = mx.where(old != size, pads, 0), old + pads
            store.pending = pads
        else:
            pairs = list(zip(pads, store.left_pad, strict=True))
            moved = mx.array([p if lp != size else 0 for p, lp in pairs], dtype=mx.int32)
            store.left_pad = [lp + p for p, lp in pairs]
            left_pad = mx.array(store.left_pad, dtype=mx.int32)
        self._store = store
        drafts, *arrays = self._fn(
            hidden, tokens, positions, moved.astype(mx.int32), left_pad.astype(mx.int32),
            mx.array([size], dtype=mx.int32), *store.arrays,
        )  # fmt: skip
        store.arrays, store.size = list(arrays), size + width
        return drafts

    def _chain(
        self,
        hidden: mx.array,
        tokens: mx.array,
        positions: mx.array,
        moved: mx.array,
        left_pad: mx.array,
        size: mx.array,
        *arrays: mx.array,
    ) -> list[mx.array]:
        """The traced body: the drafts, then the store's new arrays."""
        assert self._store is not None
        view = KVView(self._store, list(arrays), left_pad, size, moved)
        out = draft(self.model, self.head, hidden, tokens, positions, view, self.num_draft)
        return [out.tokens, *view.arrays]


class Drafter:
    """The MTP head's drafting for the rows that speculate, and its pending pairs.
    compiled: greedy batches draft through it (None: always the eager chain)."""

    def __init__(
        self, model: Qwen35Model, head: MTPHead, num_draft: int, compiled: bool = False
    ) -> None:
        self.model = model
        self.head = head
        self.num_draft = num_draft
        self.compiled = CompiledDraft(model, head, num_draft) if compiled else None
        self._pending: dict[str, _Pairs] = {}
        self._verified: _VerifiedPairs | None = None  # the last verify batch's pairs
        # A chained verify's draft (lazy pads): the head store, the chain's width and its
        # dead rows, until the verify before it is read back and settles the store
        self._unsettled: tuple[KVStore, int, int] | None = None
        # The first positions of the chained verify in flight, known on the host once
        # the verify before it is read back (its own are lazy)
        self._chain_first: tuple[int, ...] | None = None

    # -- rows -----------------------------------------------------------------------------
    def forget(self, row_ids: Sequence[str]) -> None:
        """Freed rows, or rows that decode without speculating (their pairs go stale)."""
        batch = self._verified
        if row_ids and batch is not None and not set(row_ids).isdisjoint(batch.row_ids):
            self._unbatch()
        for row_id in row_ids:
            self._pending.pop(row_id, None)

    def fork(self, child: str, parent: str) -> None:
        """A fork's first token was sampled with its parent's: it starts from its pairs."""
        if self._verified is not None and parent in self._verified.row_ids:
            self._unbatch()
        pairs = self._pending.get(parent)
        if pairs is not None and child not in self._pending:
            self._pending[child] = _Pairs(pairs.hidden, pairs.positions, pairs.tokens)

    def clear(self) -> None:
        self._pending.clear()
        self._verified = None
        self._unsettled = None
        self._chain_first = None

    def _unbatch(self) -> None:
        """The last verify batch's pairs become per-row pairs (its rows changed)."""
        batch, self._verified = self._verified, None
        if batch is not None:
            for b, row_id in enumerate(batch.row_ids):
                self._pending[row_id] = batch.row(b)

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
    def draft(
        self,
        row_ids: Sequence[str],
        state: BatchState,
        last: mx.array,
        rows: Sequence[SamplingRow],
    ) -> DraftRound:
        """The drafts of the verify batch's rows (`last` [B] their last tokens, `rows`
        what the sampler reads of each): each row's pending pairs go into its head store,
        right-aligned, then the head chains k drafts, each chosen as the row samples
        (`draft_chooser`); its k - 1 speculative pairs are rolled back at once. A row with no
        pairs (it decoded without speculating) drafts from its store alone. `state` may
        hold dead rows after the live ones (a bucketed batch, RowStates): they draft from
        nothing, and their drafts are not returned."""
        k, store = self.num_draft, state.aligned_draft()
        assert store is not None, "the verify batch has a head store"
        batch = self._verified
        if batch is not None and batch.row_ids == tuple(row_ids):
            self._verified = None  # the same rows as the last verify: one gather
            hidden, tokens, positions, pads = batch.aligned()
            if isinstance(pads, mx.array):  # chained: the head store settles at read-back
                self._unsettled = (store, hidden.shape[1], state.num_rows - len(row_ids))
            return self._chain(state, store, hidden, tokens, positions, pads, rows)
        self._unbatch()
        pairs = [self._pending.pop(r, None) for r in row_ids]
        pairs = [p if p is not None and p.tokens is not None else None for p in pairs]
        if all(p is None for p in pairs):  # nothing to draft from yet: certain drafts
            return DraftRound(mx.repeat(last[:, None], k, axis=1), None)
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
        stacked = mx.stack(hidden), mx.stack(tokens), mx.stack(positions, axis=1)
        return self._chain(state, store, *stacked, pads, rows)

    def _chain(
        self,
        state: BatchState,
        store: KVStore,
        hidden: mx.array,
        tokens: mx.array,
        positions: mx.array,
        pads: list[int] | mx.array,
        rows: Sequence[SamplingRow],
    ) -> DraftRound:
        """The head's k drafts from the live rows' right-aligned pairs (hidden [B, W, H],
        tokens [B, W], positions [3, B, W], pads per row: a lazy array for a chained
        verify's, which only the compiled chain takes); dead rows after them (a bucketed
        batch) draft from nothing and are not returned."""
        k, live = self.num_draft, hidden.shape[0]
        dead = state.num_rows - live
        extra = chain_width(state.num_rows, hidden.shape[1], k + 1) - hidden.shape[1]
        lazy = isinstance(pads, mx.array)
        assert not (lazy and extra), "lazy pairs come at the chain's width (k + 1)"
        if extra:  # the rows' pairs right-aligned at the chain's width
            hidden = mx.pad(hidden, [(0, 0), (extra, 0), (0, 0)])
            tokens = mx.pad(tokens, [(0, 0), (extra, 0)])
            positions = mx.pad(positions, [(0, 0), (0, 0), (extra, 0)])
            pads = pads + extra if isinstance(pads, mx.array) else [p + extra for p in pads]
        if dead:
            width = hidden.shape[1]
            hidden = mx.concatenate([hidden, mx.zeros((dead, *hidden.shape[1:]), hidden.dtype)])
            tokens = mx.concatenate([tokens, mx.zeros((dead, width), tokens.dtype)])
            positions = mx.concatenate(
                [positions, mx.zeros((3, dead, width), positions.dtype)], axis=1
            )
            if isinstance(pads, mx.array):
                pads = mx.concatenate([pads, mx.full((dead,), width, pads.dtype)])
            else:
                pads = [*pads, *[width] * dead]
            rows = [*rows, *[rows[-1]] * dead]  # dead rows draw as a live one, unread
        if self.compiled is not None and self.compiled.supports(store, rows):
            tokens = self.compiled(hidden, tokens, positions, pads, store)
            return DraftRound(tokens[:live] if dead else tokens, None)
        assert not lazy and isinstance(pads, list), "a chained verify drafts compiled"
        drafts = draft(
            self.model,
            self.head,
            hidden,
            tokens,
            positions,
            store,
            k,
            tuple(pads) if any(pads) else None,
            draft_chooser(rows, k),
        )
        if k > 1:
            store.rollback([k - 1] * (live + dead))
        if dead:
            return DraftRound(drafts.tokens[:live], drafts.logits[:live])
        return DraftRound(drafts.tokens, drafts.logits)

    def accept(self, step: VerifyStep, rows: Sequence[SamplingRow]) -> Verdicts:
        """Each row's accepted drafts and next token (the module docstring), with
        logprobs of the emitted tokens for rows that ask (queued, lazy). `step.logits`
        are processed already (the runner applies logit_bias and penalties per column);
        the logprobs are their log-softmax at temperature 1, as the sampler reports them.
        The kept columns become the batch's pairs for its next draft, lazy until read
        back (a chained verify drafts from them as they are)."""
        k, params = step.drafts.shape[1], [r.params for r in rows]
        verdict = verify_verdict(step, rows)
        column = mx.arange(k + 1, dtype=mx.int32)[None]
        count = verdict.num_accepted[:, None]
        padded = mx.concatenate([step.drafts, verdict.next_token[:, None]], axis=1)
        tokens = mx.where(column < count, padded, verdict.next_token[:, None])
        # the kept columns are the next draft's pairs: lazy until read back, so that a
        # verify chained onto this one drafts from them before they are known
        kept = verdict.num_accepted + 1
        self._verified = _VerifiedPairs(step.row_ids, step.hidden, tokens, step.positions, kept)
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
        self,
        verdicts: Verdicts,
        state: BatchState,
        rows: Sequence[SamplingRow],
        chained: bool = False,
    ) -> list[VerifiedRun]:
        """Wait for the verdicts; roll the verify batch back to each row's kept columns;
        the kept columns' hidden states become the rows' pending pairs. chained: a
        verify chained onto this one has rolled the batch back and drafted from those
        pairs already, with the counts still lazy (BatchState.keep_verified_pending):
        the counts read back settle the trunk's and the head's stores instead. Reads
        back only what this step computed: a chained verify may be computing behind it."""
        step, k = verdicts.step, verdicts.step.drafts.shape[1]
        counts = verdicts.num_accepted.tolist()
        tokens = verdicts.tokens.tolist()
        dead = state.num_rows - len(counts)  # a bucketed batch's dead rows keep one
        kept = tuple(a + 1 for a in counts)
        first = step.positions if isinstance(step.positions, tuple) else self._chain_first
        assert first is not None, "a chained verify's positions were never settled"
        if chained:
            state.settle_verified([*kept, *[1] * dead], k + 1)
            assert self._unsettled is not None, "a chained verify drafted from no pairs"
            store, width, dead_rows = self._unsettled
            store.settle([width - n for n in kept] + [width] * dead_rows)
            self._unsettled = None
            self._chain_first = tuple(f + n for f, n in zip(first, kept, strict=True))
        else:
            state.keep_verified([*kept, *[1] * dead], k + 1)
            self._verified = _VerifiedPairs(
                step.row_ids, step.hidden, verdicts.tokens, tuple(first), kept
            )
            self._chain_first = None
        lps = verdicts.logprobs.tolist() if verdicts.logprobs is not None else None
        ids = verdicts.top_ids.tolist() if verdicts.top_ids is not None else None
        vals = verdicts.top_logprobs.tolist() if verdicts.top_logprobs is not None else None
        for row_id in step.row_ids:
            self._pending.pop(row_id, None)
        runs = []
        for b, (row_id, a) in enumerate(zip(step.row_ids, counts, strict=True)):
            emitted = tuple(tokens[b][: a + 1])
            logprobs: list[TokenLogprob | None] = [None] * len(emitted)
            if lps is not None and rows[b].params.logprobs:
                n = rows[b].params.top_logprobs
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


def draft_chooser(rows: Sequence[SamplingRow], num_draft: int) -> Chooser:
    """How the head picks each draft of these rows: greedy rows its argmax; sampled rows
    a Gumbel-max draw from its logits under the row's warp (so exactly from q), draft i
    with the noise the plain sampler would use at the output index it stands for (seeded
    rows: the module docstring; unseeded rows: fresh random noise)."""
    params = [r.params for r in rows]
    if all(p.is_greedy for p in params):
        return greedy
    is_sampled = mx.array([not p.is_greedy for p in params])
    keys = iter([noise_keys(rows, ahead=i) for i in range(num_draft)])
    warps: dict[int, Warp] = {}

    def choose(logits: mx.array) -> mx.array:
        vocab = logits.shape[-1]
        warp = warps.setdefault(vocab, Warp.of(params, vocab))
        k0, k1 = next(keys)
        noise = gumbel_noise(k0, k1, mx.arange(vocab, dtype=mx.uint32)[None])
        drawn = mx.argmax(warp_logits(logits, warp) + noise, axis=-1).astype(mx.int32)
        return mx.where(is_sampled, drawn, greedy(logits))

    return choose


def verify_verdict(step: VerifyStep, rows: Sequence[SamplingRow]) -> Verdict:
    """The verify batch's verdicts (the module docstring): greedy rows' from
    accept_greedy; seeded sampled rows' from accept_greedy over the verify logits under
    the row's warp plus the plain sampler's noise at each column's output index;
    unseeded sampled rows' from accept_sampled with p the verify logits and q the draft
    logits, both under the row's warp, and fresh noise."""
    greedy_verdict = accept_greedy(step.logits, step.drafts)
    if all(r.params.is_greedy for r in rows):
        return greedy_verdict
    b, positions, vocab = step.logits.shape
    k = positions - 1
    warp = Warp.of([r.params for r in rows], vocab)
    flat = step.logits.reshape(b * positions, vocab)
    warped = warp_logits(flat, warp.repeat(positions)).reshape(b, positions, vocab)
    verdict = greedy_verdict
    seeded = [not r.params.is_greedy and r.params.seed is not None for r in rows]
    if any(seeded):
        ids = mx.arange(vocab, dtype=mx.uint32)[None]
        noise = [gumbel_noise(*noise_keys(rows, ahead=j), ids) for j in range(positions)]
        coupled = accept_greedy(warped + mx.stack(noise, axis=1), step.drafts)
        verdict = _pick(mx.array(seeded), coupled, verdict)
    unseeded = [not r.params.is_greedy and r.params.seed is None for r in rows]
    if any(unseeded):
        p = mx.softmax(warped, axis=-1)
        if step.draft_logits is None:
            q = (step.drafts[..., None] == mx.arange(vocab)).astype(mx.float32)
        else:
            draft_flat = step.draft_logits.reshape(b * k, vocab)
            q = warp_probs(draft_flat, warp.repeat(k)).reshape(b, k, vocab)
        k0, k1 = noise_keys(rows)
        uniform = uniform_noise(k0, k1, mx.arange(k, dtype=mx.uint32)[None])
        gumbel = gumbel_noise(*noise_keys(rows), mx.arange(vocab, dtype=mx.uint32)[None])
        sampled = accept_sampled(p, step.drafts, q, uniform, gumbel)
        verdict = _pick(mx.array(unseeded), sampled, verdict)
    return verdict


def _pick(where: mx.array, chosen: Verdict, other: Verdict) -> Verdict:
    """Row b's verdict from `chosen` where where[b], else from `other`."""
    return Verdict(
        mx.where(where, chosen.num_accepted, other.num_accepted),
        mx.where(where, chosen.next_token, other.next_token),
    )


def store_arrays(state: BatchState) -> list[mx.array]:
    """The verify batch's arrays after a step (its head store's too), to evaluate."""
    store: KVStore | None = state.draft
    head = store.state_arrays() if store is not None else []
    return state.state_arrays() + head
