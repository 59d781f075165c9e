"""The scheduler's view of one completion (one choice of a GenerationRequest)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.types import SamplingParams


class Status(Enum):
    WAITING = "waiting"  # queued; holds no row and no memory
    FORKED = "forked"  # choice > 0 of an n > 1 request: waits for its parent's prefill
    RUNNING = "running"  # holds a row (prefilling or decoding)
    FINISHED = "finished"


@dataclass
class Request:
    """Owned and mutated by the scheduler only; the runner reads token ids and counts.

    Phase-free: `num_computed` tokens are in the row state; while it is below
    `len(prompt_ids)` the request gets prefill chunks, after that one token per step.
    """

    request_id: str  # the GenerationRequest id (shared by all choices)
    index: int  # choice index
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    max_context: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    reserved_bytes: int = 0
    children: list[Request] = field(default_factory=list)  # choices forked after prefill
    # Prefix cache (set at admission): prompt tokens restored instead of computed, the
    # node chain to restore them from (cleared once its chunk is planned), and the prompt
    # positions at which to snapshot the row's state while prefilling.
    num_cached: int = 0
    prefix_hint: int = 0  # GenerationRequest.prefix_hint
    cache_chain: tuple[int, ...] = ()
    snapshot_at: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def row_id(self) -> str:
        """Unique id of this choice's row."""
        return f"{self.request_id}/{self.index}"

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def max_total_tokens(self) -> int:
        """Worst-case tokens this row will ever hold (what admission reserves for)."""
        return min(self.num_prompt + self.params.max_tokens, self.max_context)

    def finish_check(self, token: int) -> str | None:
        """Finish reason after `token` was appended, or None to keep going."""
        if not self.params.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in self.params.stop_token_ids:
            return "stop"
        if len(self.output_ids) >= self.params.max_tokens:
            return "length"
        if self.num_tokens >= self.max_context:
            return "length"
        return None
