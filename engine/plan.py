"""The contract between the scheduler and the runner: one step's plan, and its result.

A StepPlan is all a worker needs to run a step: a row's prompt, images and sampling
parameters come once, in `new_rows`, the first time the row appears; after that plans
name the row by id. So the runner never reads scheduler state, and a tensor-parallel
follower runs the very plan rank 0 runs. Plain data (no mx.array), frozen.

A StepResult is what the step computed, read back: the runner writes it, the
scheduler's update() reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.engine.prefix_cache.index import CacheDrop, CacheLoad, CacheSave
from deltaserve.engine.types import SamplingParams, TokenLogprob
from deltaserve.engine.vision.media import PromptMedia, VisionWork

__all__ = ["NewRow", "PrefillChunk", "StepPlan", "StepResult", "VerifiedRun", "VisionWork"]


@dataclass(frozen=True, eq=False)
class NewRow:
    """A row's first plan: what the worker keeps until the row is freed. Written by the
    scheduler when it admits the row (a request's n > 1 choices come together)."""

    row_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    index: int  # choice index: seeds the row's draws
    media: PromptMedia | None = None  # the prompt's images (None: text only)
    # The row may speculate (engine/speculative.py): the worker keeps the MTP head's
    # state for it from its prompt on
    speculative: bool = False


@dataclass(frozen=True)
class PrefillChunk:
    """prompt_ids[start : start + length] of one row, run as its own [1, length] group.
    Written by the scheduler's chunking policy."""

    row_id: str
    start: int
    length: int
    # Rows that sample their first token from this chunk's last logits: empty unless the
    # chunk ends the prompt; then the request's row and its n > 1 forks.
    sample_row_ids: tuple[str, ...] = ()
    # Prefix-cache node chain to build the row's state from before this chunk (its first)
    restore: tuple[int, ...] = ()
    # Vision-tower work that runs before this chunk (length 0: a chunk that only encodes),
    # and what it costs in prefill-token equivalents (the step-cost model counts it)
    vision: tuple[VisionWork, ...] = ()
    vision_tokens: int = 0
    # A prefix-cache snapshot after this many of the chunk's tokens (0 = none; one at the
    # chunk's end is a CacheSave alone)
    snapshot_at: int = 0


@dataclass(frozen=True)
class StepPlan:
    """One step. Written by Scheduler.schedule(); run by ModelRunner.execute on every
    rank; read back by Scheduler.update(). `StepPlan()` is a plan that runs nothing."""

    step: int = 0  # sequence number of this plan
    # Rows seen for the first time (their prompt, images, sampling parameters): the
    # worker keeps them until they appear in freed_row_ids
    new_rows: tuple[NewRow, ...] = ()
    freed_row_ids: tuple[str, ...] = ()  # finished/aborted since the last plan: drop them
    forks: tuple[tuple[str, str], ...] = ()  # (child, parent): copy parent's prefilled state
    decode_row_ids: tuple[str, ...] = ()  # decode batch, in batch order: one token per row
    # Input of each decode row: its last token id when known, else -1 and then
    # decode_sources[i] is the row's index in the previous plan's sampled tokens (that
    # step is still in flight when this one is built: see LLMEngine.step).
    decode_token_ids: tuple[int, ...] = ()
    decode_sources: tuple[int, ...] = ()
    decode_positions: tuple[int, ...] = ()  # rotary position of each decode row's input
    # The decode batch sits this step out (prompts run ahead of it: the scheduler's
    # run-ahead policy): its rows keep their state and place; decode_row_ids is empty.
    decode_rows_wait: bool = False
    # Rows that speculate this step (engine/speculative.py), in verify-batch order: each
    # runs its last token and num_draft drafts the worker made (the plan never carries
    # drafts), as inputs at verify_positions[i] .. + num_draft. Their last token ids are
    # known (such a step follows a read-back step: never pending), unless verify_chained.
    verify_row_ids: tuple[str, ...] = ()
    verify_token_ids: tuple[int, ...] = ()
    verify_positions: tuple[int, ...] = ()
    num_draft: int = 0
    # The verify batch is the previous plan's, a step still in flight, and this step
    # has no prompt work: its rows' last tokens and positions are what that step
    # accepts (the runner takes them from its acceptance, lazily; verify_token_ids and
    # verify_positions are empty), and a row that finished there computes this step in
    # vain (Scheduler.chained_plan); decode rows take pending inputs as usual
    verify_chained: bool = False
    # Some decode row may speculate next step, so this step's tokens are read back before
    # the next plan (not pipelined): a row whose last token is in flight cannot draft.
    read_back: bool = False
    prefill: tuple[PrefillChunk, ...] = ()  # prefill chunks, one group each
    num_tokens: int = 0  # tokens run this step (<= max_num_batched_tokens)
    cache_saves: tuple[CacheSave, ...] = ()  # rows to snapshot after their chunk ran
    cache_drop: CacheDrop | None = None  # prefix-cache arrays to free after the step
    cache_loads: tuple[CacheLoad, ...] = ()  # prefix-cache nodes read back from disk

    @property
    def sample_row_ids(self) -> tuple[str, ...]:
        """Rows that sample this step, in logits order (decode rows, then final chunks)."""
        return self.decode_row_ids + tuple(r for c in self.prefill for r in c.sample_row_ids)

    @property
    def is_empty(self) -> bool:
        """Whether the step runs no model work (it may still free or add rows)."""
        return not self.decode_row_ids and not self.prefill and not self.verify_row_ids

    @property
    def kind(self) -> str:
        """The step's kind, as engine/api.py STEP_KINDS counts it: "verify" (rows verify
        drafts), "mixed" (decode rows and prompt work), "decode", "prefill"."""
        if self.verify_row_ids:
            return "verify"
        if self.decode_row_ids:
            return "mixed" if self.prefill else "decode"
        return "prefill"


@dataclass(frozen=True)
class VerifiedRun:
    """What a speculating row got from one step: the drafts it accepted and the token
    after them, in order (1 .. num_draft + 1 tokens). Written by the runner."""

    row_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    num_drafted: int  # drafts verified (token_ids holds len - 1 of them)


@dataclass(frozen=True)
class StepResult:
    """A step's sampled tokens, read back. Written by the runner (ModelRunner.read_back),
    read by Scheduler.update(); one entry per sampling row, in plan order."""

    step: int = 0  # the plan's sequence number
    row_ids: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    verified: tuple[VerifiedRun, ...] = ()  # the speculating rows', in verify order
    # compiled shapes the step ran for the first time: their traces are in its time
    traced: int = 0
