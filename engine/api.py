"""The asyncio-facing interface of the engine, as the server uses it.

`AsyncEngine` (engine/async_engine.py) implements it: one background thread owns MLX and
runs the step loop; each request gets its own asyncio queue of RequestOutput deltas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from deltaserve.engine.types import GenerationRequest, RequestOutput
from deltaserve.kernels.platform import Platform

# Upper bounds (seconds) of the step-time histogram's buckets, and the kinds of step
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_KINDS = ("decode", "mixed", "prefill", "verify")
# Where a step's host time goes (StepTimes.host_parts): the scheduler's plan, building the
# forward's graph (Python), submitting it (mx.async_eval: MLX encodes every kernel), the
# sampler's graph and submission, and applying the tokens to the requests
HOST_PARTS = ("schedule", "build", "submit", "sample", "update")


@dataclass(frozen=True)
class StepTimes:
    """Every engine step's wall time since start (what each running stream waited for
    it), by kind: "decode" (decode rows only), "mixed" (decode rows and prompt work),
    "prefill" (prompt work only), "verify" (speculating rows verify drafts). Written by
    the scheduler (engine/scheduling/step_cost.py StepHistogram), read by /metrics."""

    # per kind (STEP_KINDS' order): steps at or under each STEP_SECONDS_BUCKETS bound,
    # cumulative as Prometheus counts them, then every step of the kind
    counts: tuple[tuple[int, ...], ...] = tuple(
        (0,) * (len(STEP_SECONDS_BUCKETS) + 1) for _ in STEP_KINDS
    )
    seconds: tuple[float, ...] = (0.0,) * len(STEP_KINDS)  # per kind, summed
    traced: int = 0  # steps that traced a compiled shape (a stall of every stream)
    # per kind, summed: the engine thread's own time on those steps (scheduling, building
    # and queueing the forward and the sampler, applying the tokens), not the wait for
    # the device; written by the engine (LLMEngine.step). On a GPU a step whose host time
    # is most of its wall time is bound by Python, not by its tokens.
    host_seconds: tuple[float, ...] = (0.0,) * len(STEP_KINDS)
    # per kind, per HOST_PARTS, summed: the parts of host_seconds (the rest is the step
    # loop's own bookkeeping); written by the engine
    host_parts: tuple[tuple[float, ...], ...] = tuple((0.0,) * len(HOST_PARTS) for _ in STEP_KINDS)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and /health. Written by the engine thread."""

    is_alive: bool
    num_waiting: int
    num_running: int
    state_bytes_in_use: int  # KV + DeltaNet state of all rows
    state_bytes_budget: int
    kv_bytes_per_token: int
    mlx_active_bytes: int
    mlx_peak_bytes: int
    prompt_tokens_total: int
    generated_tokens_total: int
    # Prefix cache (all 0 when it is off): bytes held now; since start, prompt tokens
    # looked up at admission, how many of them were restored, snapshots evicted.
    prefix_cache_bytes: int = 0
    prefix_cache_lookup_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_evictions_total: int = 0
    # Speculative decoding (0 when it is off): drafts verified and accepted since start
    speculative_drafted_tokens_total: int = 0
    speculative_accepted_tokens_total: int = 0
    # accepted drafts a verify must average to beat plain decoding, as measured on this
    # device (Speculation.break_even); -1 while not measured or speculation is off
    speculative_break_even_drafts: float = -1.0
    step_times: StepTimes = StepTimes()


@dataclass(frozen=True)
class EngineInfo:
    """What the engine runs on, fixed when it starts (for the status page)."""

    platform: Platform  # device, dtype, mlx version, BLAS, fast paths (kernels/platform.py)
    num_ranks: int = 1  # processes of a tensor-parallel group (1: none)
    prefix_cache_max_bytes: int = 0  # cap on the prefix cache (0: the cache is off)
    # The per-step token budget and chunk size in force (config's, or the device's where
    # the config left 0: EngineConfig.for_device); 0 = not reported
    max_num_batched_tokens: int = 0
    max_prefill_chunk: int = 0


class EngineClient(Protocol):
    """What the server may call. All methods are safe from the asyncio thread."""

    max_context: int  # prompt + max_tokens must not exceed this
    eos_token_ids: tuple[int, ...]  # ids that end a generation (resolved by the loader)
    info: EngineInfo

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submit and stream deltas until every choice has finished.

        Raises InvalidRequestError before any compute when the request can never run
        (too long for the context or the memory budget), and QueueFullError when the
        waiting queue is full. Closing the iterator (client gone) aborts the request;
        its rows are freed at the next step boundary.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with finish_reason "abort"."""
        ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the engine thread."""
        ...


class QueueFullError(RuntimeError):
    """The waiting queue is at capacity; retry after `retry_after` seconds (HTTP 429/503)."""

    def __init__(self, retry_after: float = 1.0) -> None:
        super().__init__("the server is at capacity; retry later")
        self.retry_after = retry_after


class EngineStoppedError(RuntimeError):
    """The engine no longer takes requests: it is shutting down, or its device failed
    (HTTP 503: another server, or this one once restarted, can run the request)."""


@dataclass(frozen=True)
class EngineSummary:
    """What the engine runs, where, and how much the row-state budget holds, in a user's
    terms (the server's start-up summary). Written once by the engine after loading."""

    platform: Platform  # where it computes and with which fast paths (kernels/platform.py)
    weight_bytes: int  # the loaded weights (text model + vision tower)
    budget_bytes: int  # the row-state cap: rows are admitted while they fit under it
    reserved_bytes: int  # row state reserved now
    max_num_seqs: int  # rows that run at once, whatever the budget holds
    max_context: int
    chat_tokens: int  # a typical chat's length (prompt + answer) for chat_rows
    chat_rows: int  # rows of chat_tokens the budget holds
    context_rows: int  # rows of the full max_context the budget holds
    prefix_cache_bytes: int  # the prefix cache's cap inside the budget (0: off)
