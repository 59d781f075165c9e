"""The scheduler's view of one completion (one choice of a GenerationRequest)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from deltaserve.engine.types import (
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from deltaserve.engine.vision.media import PromptMedia, VisionProgress


def row_id_of(request_id: str, index: int) -> str:
    """The row id of choice `index` of a request: unique among live rows."""
    return f"{request_id}/{index}"


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
    # Images (None: a text prompt): the request's choices share one PromptMedia; how far
    # their tower passes have been scheduled.
    media: PromptMedia | None = None
    vision: VisionProgress = field(default_factory=VisionProgress)
    prefill_reserved: int = 0  # budget bytes held until prefill ends (Admission.prefill_bytes)
    # Speculative decoding (engine/scheduling/speculation.py): whether the row may draft,
    # the extra columns a verify may write past its last token (reserved with the row),
    # and its drafts verified and accepted so far
    speculative: bool = False
    draft_slack: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def row_id(self) -> str:
        """Unique id of this choice's row."""
        return row_id_of(self.request_id, self.index)

    @property
    def key_ids(self) -> list[int] | tuple[int, ...]:
        """The prompt as the prefix cache keys it (image tokens carry their image)."""
        return self.media.key_ids if self.media is not None else self.prompt_ids

    @property
    def rope_delta(self) -> int:
        """Rotary position minus token index of generated tokens (images shift it)."""
        return self.media.rope_delta if self.media is not None else 0

    @property
    def vision_bytes(self) -> int:
        """Memory the vision tower needs while this row's images are encoded."""
        return self.media.vision_bytes if self.media is not None else 0

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
        """Worst-case tokens this row will ever hold (what admission reserves for): a
        speculating row's last verify may write draft_slack columns past its end."""
        total = min(self.num_prompt + self.params.max_tokens, self.max_context)
        return total + self.draft_slack

    def forced_token(self) -> int | None:
        """The token this row must write next instead of sampling (SamplingParams.
        forced_token), or None."""
        return self.params.forced_token(self.output_ids)

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

    def delta(
        self,
        tokens: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...] | None,
        reason: str | None,
        error: str | None = None,
    ) -> RequestOutput:
        """One delta of this choice's stream, with its counts as they are now."""
        return RequestOutput(
            request_id=self.request_id,
            index=self.index,
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=self.num_prompt,
            num_output_tokens=len(self.output_ids),
            num_cached_tokens=self.num_cached,
        )


def choices_of(
    gen: GenerationRequest, eos_ids: frozenset[int], media: PromptMedia | None, max_context: int
) -> list[Request]:
    """The n choices of a request, queued as one parent that forks the rest after its
    prefill; raises InvalidRequestError if the request cannot fit the context."""
    total = len(gen.prompt_ids) + gen.params.max_tokens
    if total > max_context:
        raise InvalidRequestError(
            f"prompt ({len(gen.prompt_ids)} tokens) + max_tokens ({gen.params.max_tokens}) "
            f"exceeds the context length {max_context}",
            "max_tokens",
        )
    ids = list(gen.prompt_ids)
    choices = [
        Request(gen.request_id, i, ids, gen.params, eos_ids, max_context) for i in range(gen.n)
    ]
    for r in choices:
        r.media = media
    parent, *children = choices
    parent.children = children
    parent.prefix_hint = gen.prefix_hint
    return choices
