"""Scheduling policy: admission, chunked prefill under a token budget, finishing, abort.

Pure Python: no mx.array here. Row state lives with the runner; the scheduler tells it,
through each StepPlan, which rows exist (a new one with its prompt), which run, and which
were freed or forked.

Latency bound: the scheduler times its own steps (schedule() to update(), with the
engine's clock) and feeds a StepCostModel, which sizes the prefill of steps that hold
decode rows (config.max_stall_factor). Vision-tower work is reported to it apart from
prompt tokens, and each step prices tower blocks at what the model measured them to cost
(a VisionPrice: block_tokens x vision_scale, and at most vision_limit of them next to
decode rows while that cost is still being learned).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from deltaserve.engine.api import QueueFullError
from deltaserve.engine.cache.budget import MemoryBudget
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.plan import NewRow, StepPlan, StepResult
from deltaserve.engine.prefix_cache.index import CacheSave, PrefixIndex
from deltaserve.engine.request import Request, Status, choices_of
from deltaserve.engine.scheduling.prefill_policy import MIN_PREFILL_TOKENS, PrefillPlanning
from deltaserve.engine.scheduling.step_cost import UNBOUNDED, ChunkCost, StepCostModel, StepTimer
from deltaserve.engine.types import (
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
    TokenLogprob,
)
from deltaserve.engine.vision.media import PromptMedia, VisionPrice

log = logging.getLogger(__name__)

__all__ = ["MIN_PREFILL_TOKENS", "Scheduler"]


class Scheduler(PrefillPlanning):
    """FIFO admission bounded by rows and memory; phase-free chunked prefill (admission
    and chunking: engine/scheduling/prefill_policy.py)."""

    def __init__(
        self,
        config: EngineConfig,
        budget: MemoryBudget,
        max_context: int,
        clock: Callable[[], float] = time.perf_counter,
        prefix: PrefixIndex | None = None,
        chunk_cost: ChunkCost | None = None,
    ) -> None:
        """prefix: the prefix cache's index (None: no prefix cache). chunk_cost: what a
        prompt chunk costs on this device, measured at start (None: not measured)."""
        self.config = config
        self.budget = budget
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # running rows still consuming their prompt
        self.decoding: list[Request] = []  # decode batch, in row order
        self.rows: dict[str, Request] = {}  # every row that holds state (row_id -> request)
        self._new_rows: list[NewRow] = []  # admitted since the last plan
        self._freed: list[str] = []
        self._forks: list[tuple[str, str]] = []
        self._promote_next: list[Request] = []  # final chunk scheduled; decode from next step
        self._pending: dict[str, int] = {}  # row -> index in the last step's samples
        self._num_steps = 0
        self._pending_step = -1  # the step whose samples `_pending` refers to
        self.step_cost = StepCostModel(chunk_cost)
        self._clock = clock
        self._timer = StepTimer()
        self._price = VisionPrice()  # what tower blocks cost in this step's plan
        self.prefix = prefix
        self._saves: list[CacheSave] = []
        self._ahead_seconds = 0.0  # predicted cost of the jump just planned (0: none)
        self._promise: int | None = None  # allowance last logged as unattainable's
        # The engine sets it where a forward can keep DeltaNet state mid-chunk (eager core)
        self.snapshot_in_chunk = False  # False: a chunk ends at each snapshot

    # -- intake -------------------------------------------------------------------------
    def add(
        self, gen: GenerationRequest, eos_ids: frozenset[int], media: PromptMedia | None = None
    ) -> None:
        """Queue a request; raise InvalidRequestError if it can never run."""
        live = [*self.waiting, *self.rows.values()]
        if any(r.request_id == gen.request_id for r in live):
            raise InvalidRequestError(f"request id {gen.request_id!r} is already in use", None)
        choices = choices_of(gen, eos_ids, media, self.max_context)
        need = sum(self.budget.row_bytes(r.max_total_tokens()) for r in choices)
        need += choices[0].vision_bytes
        if need > self.budget.total:
            raise InvalidRequestError(
                f"this request needs {need / 2**20:.1f} MiB of row state, more than the "
                f"memory budget of {self.budget.total / 2**20:.1f} MiB; lower max_tokens or n",
                "max_tokens",
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError()
        self.waiting.append(choices[0])

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every unfinished choice of `request_id` with reason "abort"."""
        victims = [r for r in self.waiting if r.request_id == request_id]
        for r in victims:
            self.waiting.remove(r)
            victims.extend(r.children)
        victims += [r for r in self.rows.values() if r.request_id == request_id]
        return [self._finish(r, "abort") for r in victims if not r.is_finished]

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self._freed)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step under the token budget.

        Every decoding row runs one token. Prefill gets an allowance: the rest of the token
        budget, cut (when rows decode and step costs are known) to what keeps this step
        within max_stall_factor x a decode-only step. Prompts being prefilled, oldest
        first, then waiting requests (admitted now, prefilling in this same step) share it
        fairly. A long prompt therefore advances every step while the decode rows keep
        producing tokens at a bounded pace: nobody waits for a whole prompt (but for one
        decode-only step at a batch size not measured lately: StepCostModel.knows_decode).
        Or, where prompts can finish within what the rows may wait, those prompts alone,
        ahead of the rows (PrefillPlanning._plan_jump); the next step then has the rows.
        """
        started = self._clock()
        for req in self._promote_next:
            self._promote(req)
        self._promote_next = []
        chunks, decoding = self._plan_jump(), []
        if not chunks:  # the usual step: every decode row, prefill next to them
            chunks, decoding = self._plan_prefill(self._prefill_allowance()), self.decoding
            self._ahead_seconds = 0.0
        num_prefill = sum(c.length for c in chunks)
        out = StepPlan(
            new_rows=tuple(self._new_rows),
            decode_row_ids=tuple(r.row_id for r in decoding),
            decode_token_ids=tuple(
                -1 if r.row_id in self._pending else r.output_ids[-1] for r in decoding
            ),
            decode_sources=tuple(self._pending.get(r.row_id, -1) for r in decoding),
            decode_positions=tuple(r.num_computed + r.rope_delta for r in decoding),
            prefill=tuple(chunks),
            freed_row_ids=tuple(self._freed),
            forks=tuple(self._forks),
            num_tokens=len(decoding) + num_prefill,
            decode_rows_wait=bool(self.decoding) and not decoding,
            step=self._num_steps,
            cache_saves=tuple(self._saves),
            cache_drop=self.prefix.take_drops() if self.prefix is not None else None,
            cache_loads=self.prefix.take_loads() if self.prefix is not None else (),
        )
        self._saves = []
        if not out.is_empty:
            self._timer.planned(out.step, started)
        # The plan is committed now, so the next step can be planned before this one's
        # tokens are known: counts advance here, tokens are appended in update().
        for req in decoding:
            req.num_computed += 1
        for chunk in chunks:
            req = self.rows[chunk.row_id]
            req.num_computed += chunk.length
            if chunk.sample_row_ids:
                self._promote_next.append(req)
        self._pending = {r: i for i, r in enumerate(out.sample_row_ids)}
        self._pending_step = self._num_steps
        self._num_steps += 1
        self._new_rows, self._freed, self._forks = [], [], []
        return out

    def _prefill_allowance(self) -> int:
        """Prefill tokens this step: the token budget, or less to bound the decode stall.
        Sets the step's price of tower blocks (in those tokens) as a side effect."""
        budget = self.config.max_num_batched_tokens - len(self.decoding)
        factor = self.config.max_stall_factor
        scale = self.step_cost.vision_scale() if factor else 1.0
        self._price = VisionPrice(scale)
        if not factor or not self.decoding:
            return budget  # nobody waits on this step: prefill at full speed
        spent = self._ahead_seconds  # the rows already waited for a jump
        allowance = self.step_cost.prefill_allowance(len(self.decoding), factor, spent)
        if allowance is None:
            return budget  # costs not learned yet
        if allowance == UNBOUNDED:  # no chunk meets the bound (measured): nothing to size
            self._log_promise(budget, factor)
            return budget
        if not self.step_cost.knows_decode(len(self.decoding)):
            return 0  # decode-only steps measure this batch size (StepCostModel)
        self._price = VisionPrice(scale, self.step_cost.vision_limit())
        allowance = min(budget, max(allowance, MIN_PREFILL_TOKENS))
        self._log_promise(allowance, factor)
        return allowance

    def _log_promise(self, allowance: int, factor: float) -> None:
        """Say once (and again when it changes) that the stall bound cannot be met here,
        and what the steps with prompt work cost instead."""
        if not (self.prefilling or self.waiting):
            return  # no prompt to advance: nothing is promised this step
        line, last = self.step_cost.unattainable, self._promise
        if line is None:
            if last is not None:
                log.info("prompt chunks fit the %.1fx stall bound again", factor)
            self._promise = None
            return
        if last is not None and last / 2 <= allowance <= 2 * last:
            return  # said already (about this size)
        decode = self.step_cost.decode_seconds(len(self.decoding))
        step = decode + line[0] + line[1] * allowance
        log.info(
            "a prompt chunk next to %d decode rows costs a fixed %.1f ms (a decode step "
            "%.1f ms): the %.1fx stall bound cannot be met; prompts advance in chunks of "
            "up to %d tokens, steps of ~%.1f ms (%.1fx)",
            len(self.decoding), 1e3 * line[0], 1e3 * decode, factor, allowance,
            1e3 * step, step / decode,
        )  # fmt: skip
        self._promise = allowance

    # -- after the forward ----------------------------------------------------------------
    def update(self, out: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append the step's sampled tokens and finish rows; returns the deltas."""
        self._observe_step_time(out)
        if out.step == self._pending_step:
            self._pending = {}  # planned and updated in lockstep: every token is known
        outputs = []
        rows = zip(result.row_ids, result.token_ids, result.logprobs, strict=True)
        for row_id, token, lp in rows:
            req = self.rows.get(row_id)
            if req is None or req.is_finished:
                continue  # finished while this step was in flight: its token is dropped
            outputs.append(self._append(req, token, lp))
        return outputs

    def _observe_step_time(self, out: StepPlan) -> None:
        """Feed the step's wall time (StepTimer) to the cost model."""
        done = self._clock()
        seconds, settled = self._timer.completed(out.step, done)
        num_prefill = sum(c.length for c in out.prefill)
        num_vision = sum(c.vision_tokens for c in out.prefill)
        first = sum(len(c.sample_row_ids) for c in out.prefill)
        log.debug("step %d: %d decode rows, %d prompt tokens, %d tower units: %.3f s",
                  out.step, len(out.decode_row_ids), num_prefill, num_vision, seconds)  # fmt: skip
        if settled:
            rows = len(out.decode_row_ids)
            self.step_cost.observe(rows, num_prefill, seconds, num_vision, done, first)

    def _promote(self, req: Request) -> None:
        """Prefill done: the request and its forks join the decode batch (a choice that
        already finished on its first token stays out; forks still copy its state)."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        if not req.is_finished:  # else _finish gave back all of it, the tower's part too
            self.budget.release(req.vision_reserved)
            req.reserved_bytes -= req.vision_reserved
        req.vision_reserved = 0
        for child in req.children:
            if child.is_finished:
                continue
            child.num_computed = req.num_computed
            child.status = Status.RUNNING
            self._forks.append((child.row_id, req.row_id))
        joining = [r for r in (req, *req.children) if not r.is_finished]
        self.decoding.extend(joining)

    def _append(self, req: Request, token: int, lp: TokenLogprob | None) -> RequestOutput:
        req.output_ids.append(token)
        reason = req.finish_check(token)
        if reason is not None:
            self._finish(req, reason)
        return req.delta((token,), (lp,) if lp is not None else None, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        req.status, req.finish_reason = Status.FINISHED, reason
        if req.row_id in self.rows:
            del self.rows[req.row_id]
            self.budget.release(req.reserved_bytes)
            self.budget.padding = self.budget.padding_bytes(self._lengths())
            self._freed.append(req.row_id)
        if req in self.decoding:
            self.decoding.remove(req)
        if req in self.prefilling and req not in self._promote_next:
            self.prefilling.remove(req)
            # Forks that will never get their parent's prefilled state die with it.
            for child in req.children:
                if not child.is_finished:
                    self._finish(child, reason, error)
        return req.delta((), None, reason, error)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every row and queued request with an error (the step raised; the engine
        drops every row state with it: RowStates.reset, so nothing is left to free)."""
        victims = list(self.rows.values()) + [r for w in self.waiting for r in (w, *w.children)]
        self.waiting.clear()
        self._timer = StepTimer()
        if self.prefix is not None:
            self.prefix.forget()  # its arrays went with the row states
        # All reservations at once: the accounting may be broken, and this must not raise.
        for req in victims:
            req.reserved_bytes = req.vision_reserved = 0
        outputs = [self._finish(r, "error", error) for r in victims if not r.is_finished]
        self.budget.clear()
        self.prefilling, self.decoding, self._pending = [], [], {}
        self._promote_next, self._freed, self._forks, self._saves = [], [], [], []
        self._new_rows = []
        self._ahead_seconds = 0.0
        return outputs
