"""Grammar matchers of the constrained rows, owned by the engine thread.

One matcher per choice of a constrained request, keyed by its row id, created when the
request is added and dropped when the choice finishes. The engine
drives it once per step, in pipeline order:
- after step N-1's tokens are read back, accept() advances each matcher by its token;
- then masks() computes step N's allowed tokens for the rows that sample (llguidance's
  executor, in parallel threads, while the device still runs step N's forward: the
  runner queued it before the read-back);
- the sampler applies them as one batched operation.
A row whose constraint starts after a token (`</think>`) runs free until it has sampled
that token. Choices of an n > 1 request fork right after the prefill, before any token:
each starts from a copy of the compiled template, which is the parent's state then.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance as llg
import numpy as np

from deltaserve.engine.structured.grammar import CompiledGrammar, GrammarCompiler
from deltaserve.engine.structured.spec import Constraint
from deltaserve.engine.types import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenMask:
    """Allowed next tokens of one sampling batch.

    bits: [N, ceil(V / 32)] int32, one row per sampling row; token t is allowed when bit
    t % 32 of word t // 32 is set (llguidance's layout). Unconstrained rows are all ones.
    rows: the batch positions that are constrained this step.
    """

    bits: np.ndarray
    rows: tuple[int, ...]


@dataclass
class _RowState:
    matcher: llg.LLMatcher
    start_after: int | None  # the matcher is off until this token is sampled
    broken: bool = False  # the matcher failed: the row may only end (EOS)


class RowConstraints:
    """Matchers of every constrained row; not thread-safe (the engine thread's)."""

    def __init__(self, compiler: GrammarCompiler, vocab_size: int, eos_ids: Iterable[int]) -> None:
        """compiler: the model's grammar compiler (its tokenizer loads on first use)."""
        self.compiler = compiler
        self.words = (vocab_size + 31) // 32
        self._rows: dict[str, _RowState] = {}
        self._executor = llg.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
        self._eos_only = np.zeros(self.words, dtype=np.int32)
        for token in eos_ids:
            self._eos_only.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))

    def __len__(self) -> int:
        return len(self._rows)

    def compile(self, spec: Constraint | None) -> CompiledGrammar | None:
        """The compiled grammar of a request's constraint (a cache hit when the server
        compiled it first); raises InvalidRequestError when it cannot compile."""
        return None if spec is None else self.compiler.compile(spec)

    def add(
        self, row_ids: Iterable[str], compiled: CompiledGrammar, params: SamplingParams
    ) -> None:
        """Give each row (the choices of a request) its own matcher in the grammar's start
        state."""
        assert params.constraint is not None, "a constrained request without its constraint"
        start_after = params.constraint.start_after_token_id
        for row_id in row_ids:
            self._rows[row_id] = _RowState(compiled.matcher.deep_copy(), start_after)

    def release(self, row_ids: Iterable[str]) -> None:
        """Drop the matchers of finished or aborted rows (unknown ids are ignored)."""
        for row_id in row_ids:
            self._rows.pop(row_id, None)

    def clear(self) -> None:
        self._rows.clear()

    def accept(self, row_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """Advance each row's matcher by the token it sampled (rows released since that
        step was planned are skipped: their tokens are dropped)."""
        for key, token in zip(row_ids, tokens, strict=True):
            row = self._rows.get(key)
            if row is None or row.broken:
                continue
            if row.start_after is not None:
                if token == row.start_after:
                    row.start_after = None  # the constrained part starts with the next token
                continue
            if not row.matcher.consume_token(token):
                self._break(key, row)

    def accept_runs(self, runs: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Advance each speculating row's matcher by the tokens its verify kept, in order
        (a token after the grammar stopped is past the row's end: dropped)."""
        for key, tokens in runs:
            for token in tokens:
                row = self._rows.get(key)
                live = row is not None and not row.broken and row.start_after is None
                if live and row.matcher.is_stopped():
                    break
                self.accept([key], [token])

    def verify_masks(
        self, row_ids: Sequence[str], drafts: Sequence[Sequence[int]]
    ) -> np.ndarray | None:
        """Allowed tokens at each verify column of the rows (None: no row is
        constrained): [B, k + 1, words], column j the mask after the row's first j
        drafts, as masks() would give when they had been sampled. Columns past a draft
        the grammar refuses are all ones (the verify rejects that draft, so they are
        never read); each matcher is rolled back to where it was."""
        if not any(key in self._rows for key in row_ids):
            return None
        columns = len(drafts[0]) + 1
        bits = np.full((len(row_ids), columns, self.words), -1, dtype=np.int32)
        # per row: where its grammar starts (0 unless a start_after token is drafted)
        # and how many drafts its matcher walks from there
        starts, walks = {}, {}
        for b, key in enumerate(row_ids):
            row = self._rows.get(key)
            if row is None:
                continue
            if row.broken:
                bits[b] = self._eos_only
                continue
            start, seq = 0, list(drafts[b])
            if row.start_after is not None:  # free until it drafts start_after
                if row.start_after not in seq:
                    continue
                start = seq.index(row.start_after) + 1
                seq = seq[start:]
            starts[b] = start
            walks[b] = row.matcher.validate_tokens(seq) if seq else 0
        ptr, stride = bits.ctypes.data, self.words * 4
        for j in range(columns):
            live = []
            for b, start in starts.items():
                if start <= j <= start + walks[b]:
                    live.append((self._rows[row_ids[b]].matcher, b * columns + j))
            if live:
                self._executor.unsafe_compute_mask_ptr(live, ptr, stride, len(bits) * columns)
            for b, start in starts.items():
                if start <= j < start + walks[b]:
                    self._rows[row_ids[b]].matcher.consume_token(drafts[b][j])
        for b, walked in walks.items():
            if walked:
                self._rows[row_ids[b]].matcher.rollback(walked)
        empty = ~bits.any(axis=2)
        bits[empty] = self._eos_only  # a stopped grammar: only the end may follow
        return bits

    def masks(self, row_ids: Sequence[str]) -> TokenMask | None:
        """The allowed tokens of a batch of `row_ids` (None: nothing to mask)."""
        active = [(i, self._rows.get(key)) for i, key in enumerate(row_ids)]
        active = [(i, row) for i, row in active if row is not None and row.start_after is None]
        if not active:
            return None
        bits = np.full((len(row_ids), self.words), -1, dtype=np.int32)
        live = [(row.matcher, i) for i, row in active if not row.broken]
        if live:
            ptr = bits.ctypes.data  # rows are contiguous: row i starts at i * words * 4
            self._executor.unsafe_compute_mask_ptr(live, ptr, self.words * 4, len(row_ids))
        for i, row in active:
            if not row.broken and (row.matcher.is_error() or not bits[i].any()):
                self._break(row_ids[i], row)  # an empty mask would leave nothing to draw
            if row.broken:
                bits[i] = self._eos_only
        return TokenMask(bits, tuple(i for i, _ in active))

    def _break(self, key: str, row: _RowState) -> None:
        # A token the mask allowed was refused, or a grammar limit was hit: a bug or a
        # pathological grammar. The row may only end now; its output is not guaranteed.
        reason = row.matcher.get_error().split("\n")[0] or "no token allowed"
        log.error("grammar matcher of %s failed: %s", key, reason)
        row.broken = True
