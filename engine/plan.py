"""One step's plan: what the scheduler decided and the runner executes.

Plain data (no mx.array), written by the scheduler, read by the runner and by the
scheduler's update() once the step's tokens are known.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.engine.prefix_cache.index import CacheDrop, CacheLoad, CacheSave


@dataclass(frozen=True)
class VisionWork:
    """Blocks [start, stop) of one image's vision-tower pass (start 0: the patch
    embedding runs first; stop = depth: the merger runs after, giving the features)."""

    image: int  # index into the row's images
    start: int
    stop: int


@dataclass(frozen=True)
class PrefillChunk:
    """prompt_ids[start : start + length] of one row, run as its own [1, length] group."""

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
class SchedulerOutput:
    """One step's plan. Written by the scheduler, read by the runner and update()."""

    decode_row_ids: tuple[str, ...]  # decode batch, in batch order: one token per row
    # Input of each decode row: its last token id when known, else -1 and then
    # decode_sources[i] is the row's index in the previous step's sampled tokens (that step
    # is still in flight when this one is built: see LLMEngine.step).
    decode_token_ids: tuple[int, ...]
    decode_sources: tuple[int, ...]
    decode_positions: tuple[int, ...]  # rotary position of each decode row's input token
    prefill: tuple[PrefillChunk, ...]  # prefill chunks, one group each
    freed_row_ids: tuple[str, ...]  # finished/aborted since last step: drop their state
    forks: tuple[tuple[str, str], ...]  # (child, parent): copy parent's prefilled state
    num_tokens: int  # tokens run this step (<= max_num_batched_tokens)
    step: int = 0  # sequence number of this plan
    cache_saves: tuple[CacheSave, ...] = ()  # rows to snapshot after their chunk ran
    cache_drop: CacheDrop | None = None  # prefix-cache arrays to free after the step
    cache_loads: tuple[CacheLoad, ...] = ()  # prefix-cache nodes read back from disk
    # The decode batch sits this step out (prompts run ahead of it: PrefillPlanning.
    # _plan_jump): its rows keep their state and place; decode_row_ids is empty.
    decode_rows_wait: bool = False

    @property
    def sample_row_ids(self) -> list[str]:
        """Rows that sample this step, in logits order (decode rows, then final chunks)."""
        return list(self.decode_row_ids) + [r for c in self.prefill for r in c.sample_row_ids]

    @property
    def is_empty(self) -> bool:
        return not self.decode_row_ids and not self.prefill
