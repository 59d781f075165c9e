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
from collections.abc import Callable, Sequence

from deltaserve.engine.api import QueueFullError
from deltaserve.engine.cache.budget import MemoryBudget
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.plan import PrefillChunk, StepPlan, StepResult, VerifiedRun
from deltaserve.engine.prefix_cache.index import PrefixIndex
from deltaserve.engine.request import Request, Status, choices_of
from deltaserve.engine.rows import ReleaseHook, RowTable
from deltaserve.engine.scheduling.prefill_policy import (
    MIN_PREFILL_TOKENS,
    Admission,
    Chunking,
    RunAhead,
    StallBound,
)
from deltaserve.engine.scheduling.speculation import Speculation
from deltaserve.engine.scheduling.state import SchedulerState
from deltaserve.engine.scheduling.step_cost import (
    ChunkCost,
    StepCostModel,
    StepHistogram,
    StepTimer,
)
from deltaserve.engine.types import (
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
    TokenLogprob,
)
from deltaserve.engine.vision.media import PromptMedia

log = logging.getLogger(__name__)

SLOW_STEP_SECONDS = 0.25  # a step this long is logged (at INFO): every decode row waited
SLOW_STEP_FACTOR = 10.0  # ... and this many decode steps of its rows long
SLOW_STEP_EVERY = 10.0  # seconds between such lines, unless the step traced a shape

__all__ = ["MIN_PREFILL_TOKENS", "Scheduler"]


class Scheduler:
    """FIFO admission bounded by rows and memory; phase-free chunked prefill. The policies
    (engine/scheduling/prefill_policy.py) are objects over one SchedulerState."""

    def __init__(
        self,
        config: EngineConfig,
        budget: MemoryBudget,
        max_context: int,
        clock: Callable[[], float] = time.perf_counter,
        prefix: PrefixIndex | None = None,
        chunk_cost: ChunkCost | None = None,
        snapshot_in_chunk: bool = False,
        on_release: Sequence[ReleaseHook] = (),
        speculation: Speculation | None = None,
        compiled_chunks: bool = False,
        pipelined: bool = False,
    ) -> None:
        """prefix: the prefix cache's index (None: no prefix cache). chunk_cost: what a
        prompt chunk costs on this device, measured at start (None: not measured).
        snapshot_in_chunk: a forward can keep DeltaNet state mid-chunk (an eager core), so
        a snapshot need not end its chunk. on_release: what else holds a piece of each
        row (RowTable), released when the row ends. speculation: which decoding rows
        draft (None: none do). compiled_chunks: a prompt's later chunks run compiled at
        bucketed lengths and KV capacities (engine/shapes.py), which chunking and the
        memory reservation plan for. pipelined: decode steps are queued before the last
        one is read back (RunAhead prices a jump's refill)."""
        self.config = config
        self.budget = budget
        self.max_context = max_context
        self.prefix = prefix
        self.speculation = speculation
        hooks = (*on_release, speculation.release) if speculation is not None else on_release
        self.state = SchedulerState(RowTable(budget, hooks))
        self.step_cost = StepCostModel(chunk_cost)
        # whole prompts where a chunk's fixed cost was measured (a GPU): Chunking says why
        whole = chunk_cost is not None
        group = chunk_cost.floor_tokens() if chunk_cost is not None else 0
        self.chunking = Chunking(
            self.state, config, prefix, snapshot_in_chunk, whole, compiled_chunks, group
        )
        self.admission = Admission(
            self.state, config, budget, prefix, self.chunking, compiled_chunks
        )
        self.run_ahead = RunAhead(
            self.state, config, self.step_cost, self.admission, self.chunking, pipelined
        )
        self.stall = StallBound(self.state, config, self.step_cost, clock)
        self._promote_next: list[Request] = []  # final chunk scheduled; decode from next step
        self._pending: dict[str, int] = {}  # row -> index in the last step's samples
        self._num_steps = 0
        self._pending_step = -1  # the step whose samples `_pending` refers to
        # a verify step without prompt work, planned and not updated yet: (its step, its
        # verify rows), onto which chained_plan may chain the next
        self._verify_in_flight: tuple[int, tuple[str, ...]] | None = None
        self._clock = clock
        self._timer = StepTimer()
        self.step_times = StepHistogram()  # every step's wall time, for /metrics
        self._slow_said = float("-inf")  # when a slow step was last logged (the clock)
        self._slow_unsaid = 0  # slow steps since then, not logged

    @property
    def rows(self) -> dict[str, Request]:
        """Every row that holds state (row_id -> request); read-only by convention."""
        return self.state.table.rows

    @property
    def waiting(self) -> Sequence[Request]:
        """Queued requests (their first choice), oldest first."""
        return self.state.waiting

    # -- intake -------------------------------------------------------------------------
    def add(
        self, gen: GenerationRequest, eos_ids: frozenset[int], media: PromptMedia | None = None
    ) -> None:
        """Queue a request; raise InvalidRequestError if it can never run."""
        live = [*self.waiting, *self.rows.values()]
        if any(r.request_id == gen.request_id for r in live):
            raise InvalidRequestError(f"request id {gen.request_id!r} is already in use", None)
        choices = choices_of(gen, eos_ids, media, self.max_context)
        if self.speculation is not None and gen.params.speculative:
            for r in choices:
                r.speculative, r.draft_slack = True, self.speculation.num_draft
        need = sum(self.budget.row_bytes(r.max_total_tokens(), r.speculative) for r in choices)
        need += self.admission.prefill_bytes(choices[0])
        if need > self.budget.total:
            raise InvalidRequestError(
                f"this request needs {need / 2**20:.1f} MiB of row state, more than the "
                f"memory budget of {self.budget.total / 2**20:.1f} MiB; lower max_tokens or n",
                "max_tokens",
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError()
        self.state.waiting.append(choices[0])

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every unfinished choice of `request_id` with reason "abort"."""
        victims = [r for r in self.waiting if r.request_id == request_id]
        for r in victims:
            self.state.waiting.remove(r)
            victims.extend(r.children)
        victims += [r for r in self.rows.values() if r.request_id == request_id]
        return [self._finish(r, "abort") for r in victims if not r.is_finished]

    def has_work(self) -> bool:
        st = self.state
        return bool(st.waiting or st.prefilling or st.decoding or st.table.has_freed())

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
        ahead of the rows (RunAhead); the next step then has the rows.
        Rows that speculate this step (Speculation) run 1 + k tokens and learn in
        update() how many of them they keep; none do at a batch size whose plain decode
        step was not measured lately (the price a verify is weighed against).
        """
        started = self._clock()
        for req in self._promote_next:
            self._promote(req)
        self._promote_next = []
        verifying = self._speculating()
        self.state.num_draft_tokens = len(verifying) * self._num_draft
        chunks, decoding = self.run_ahead.plan(), []
        if not chunks:  # the usual step: every decode row, prefill next to them
            chunks = self.chunking.plan(self.stall.allowance(), self.admission)
            decoding = self.state.decoding
            self.state.ahead_seconds = 0.0
        out = self._plan(chunks, decoding, verifying)
        if not out.is_empty:
            self._timer.planned(out.step, started)
        self._commit(out)
        return out

    def chained_plan(self) -> StepPlan | None:
        """A verify step of the verify step in flight's rows (and its plain decode rows,
        decoding on), planned before that step is read back (StepPlan.verify_chained:
        the worker takes each row's last token and position from its acceptance), or
        None where the next step must know what it accepted: any other work (a waiting
        request, a prompt, a row freed or promoted), a verifying row that would not
        speculate, or one within reach of its limits (Speculation.speculates with the
        k + 1 tokens in flight), or a plain row that may draft next. A row that finishes
        in the step in flight (an end-of-sequence token) computes the chained step in
        vain; its tokens are dropped (update)."""
        spec, st, inflight = self.speculation, self.state, self._verify_in_flight
        if spec is None or inflight is None:
            return None
        if st.waiting or st.prefilling or self._promote_next or st.table.has_freed():
            return None
        if st.new_rows or st.forks or st.saves:
            return None
        verifying = set(inflight[1])
        verify = [r for r in st.decoding if r.row_id in verifying]
        decode = [r for r in st.decoding if r.row_id not in verifying]
        if tuple(r.row_id for r in verify) != inflight[1]:
            return None
        ahead, step = spec.num_draft + 1, self._num_steps
        if not all(spec.speculates(r, step, ahead) for r in verify):
            return None
        # the plain rows decode on from the step in flight's tokens; one that may draft
        # next needs its token read back first (StepPlan.read_back: a lockstep step)
        if self._may_speculate_next(decode):
            return None
        if len(decode) + len(verify) * ahead > self.config.max_num_batched_tokens:
            return None
        started = self._clock()
        out = self._plan([], st.decoding, verifying, chained=True)
        self._timer.planned(out.step, started)
        self._commit(out)
        return out

    @property
    def _num_draft(self) -> int:
        return self.speculation.num_draft if self.speculation is not None else 0

    def _speculating(self) -> set[str]:
        """Decoding rows that draft this step, as many as the token budget holds beside
        one token per decode row; not one whose last token is still in flight (a
        pipelined step's: the drafts need it)."""
        spec, decoding, cost = self.speculation, self.state.decoding, self.step_cost
        if spec is None:
            return set()
        if not (cost.is_ready and cost.knows_decode(len(decoding))):
            return set()  # a plain step measures what verifies are weighed against
        room = (self.config.max_num_batched_tokens - len(decoding)) // spec.num_draft
        rows = [
            r.row_id
            for r in decoding
            if r.row_id not in self._pending and spec.speculates(r, self._num_steps)
        ]
        return set(rows[: max(room, 0)])

    def _may_speculate_next(self, decoding: list[Request]) -> bool:
        """Whether a row decoding plainly this step may draft in the next one: then this
        step is read back before the next plan, or its token would still be in flight
        (a pipelined step's) and the row could never draft."""
        spec = self.speculation
        return spec is not None and any(spec.speculates(r, self._num_steps + 1) for r in decoding)

    def _plan(
        self,
        chunks: list[PrefillChunk],
        decoding: list[Request],
        verifying: set[str],
        chained: bool = False,
    ) -> StepPlan:
        """The step's plan, with everything gathered for it since the last one (chained:
        chained_plan's, whose verify rows' tokens and positions are still computing)."""
        st, prefix = self.state, self.prefix
        verify = [r for r in decoding if r.row_id in verifying]
        decoding = [r for r in decoding if r.row_id not in verifying]
        k = self._num_draft if verify else 0
        plan = StepPlan(
            step=self._num_steps,
            new_rows=tuple(st.new_rows),
            freed_row_ids=st.table.take_freed(),
            forks=tuple(st.forks),
            decode_row_ids=tuple(r.row_id for r in decoding),
            decode_token_ids=tuple(
                -1 if r.row_id in self._pending else r.output_ids[-1] for r in decoding
            ),
            decode_sources=tuple(self._pending.get(r.row_id, -1) for r in decoding),
            decode_positions=_positions(decoding),
            decode_rows_wait=bool(st.decoding) and not decoding and not verify,
            verify_row_ids=tuple(r.row_id for r in verify),
            verify_token_ids=() if chained else tuple(r.output_ids[-1] for r in verify),
            verify_positions=() if chained else _positions(verify),
            num_draft=k,
            verify_chained=chained,
            read_back=self._may_speculate_next(decoding),
            prefill=tuple(chunks),
            num_tokens=len(decoding) + (k + 1) * len(verify) + sum(c.length for c in chunks),
            cache_saves=tuple(st.saves),
            cache_drop=prefix.take_drops() if prefix is not None else None,
            cache_loads=prefix.take_loads() if prefix is not None else (),
        )
        st.new_rows, st.forks, st.saves = [], [], []
        return plan

    def _commit(self, out: StepPlan) -> None:
        """The plan is committed, so the next step can be planned before this one's tokens
        are known: counts advance here, tokens are appended in update() (a speculating
        row's count too: it keeps what it accepted)."""
        for row_id in out.decode_row_ids:
            self.rows[row_id].num_computed += 1
        for chunk in out.prefill:
            req = self.rows[chunk.row_id]
            req.num_computed += chunk.length
            if chunk.sample_row_ids:
                self._promote_next.append(req)
        self._pending = {r: i for i, r in enumerate(out.sample_row_ids)}
        self._pending_step = self._num_steps
        chainable = out.verify_row_ids and not out.prefill
        self._verify_in_flight = (out.step, out.verify_row_ids) if chainable else None
        self._num_steps += 1

    # -- after the forward ----------------------------------------------------------------
    def submitted(self, out: StepPlan) -> None:
        """The step's forward is queued (graph built and submitted): the step timer
        prices its building to it, not to the step whose gap it ran in (StepTimer)."""
        self._timer.submitted(out.step, self._clock())

    def update(self, out: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append the step's sampled tokens and finish rows; returns the deltas."""
        self._observe_step_time(out, result.traced)
        if out.step == self._pending_step:
            self._pending = {}  # planned and updated in lockstep: every token is known
        if self._verify_in_flight is not None and self._verify_in_flight[0] == out.step:
            self._verify_in_flight = None  # read back: a next verify plans as usual
        outputs = self._append_sampled(result)
        for run in result.verified:
            delta = self._verified(out, run)
            if delta is not None:
                outputs.append(delta)
        return outputs

    def update_first(self, result: StepResult) -> list[RequestOutput]:
        """A lockstep step's decode rows' tokens, read back while its prompt forward still
        computes (EngineConfig.publish_decode_first): appended now, so that their streams
        do not wait for the prompt chunk; update() then takes the step's other rows and
        observes its time."""
        assert not result.verified, "verified runs come with the step's other rows"
        return self._append_sampled(result)

    def _append_sampled(self, result: StepResult) -> list[RequestOutput]:
        """One sampled token per row of `result`; the deltas."""
        outputs = []
        rows = zip(result.row_ids, result.token_ids, result.logprobs, strict=True)
        for row_id, token, lp in rows:
            req = self.rows.get(row_id)
            if req is None or req.is_finished:
                continue  # finished while this step was in flight: its token is dropped
            outputs.append(self._append(req, (token,), (lp,)))
        return outputs

    def _verified(self, out: StepPlan, run: VerifiedRun) -> RequestOutput | None:
        """A speculating row's tokens: appended one by one until one finishes the row
        (the rest are dropped); its state holds what it ran and kept."""
        req = self.rows.get(run.row_id)
        if req is None or req.is_finished:
            return None  # aborted while its step ran
        assert self.speculation is not None, "a verified run without speculation"
        self.speculation.observe(req, run.num_drafted, len(run.token_ids) - 1, out.step)
        req.num_computed += len(run.token_ids)
        return self._append(req, run.token_ids, run.logprobs)

    def _observe_step_time(self, out: StepPlan, traced: int = 0) -> None:
        """Feed the step's wall time (StepTimer) to the cost model, unless it traced a
        compiled shape (`traced`: a one-off, ~0.4 s on an H200, that would price every
        later step of its kind); say when a step was slow."""
        done = self._clock()
        seconds, settled = self._timer.completed(out.step, done)
        num_prefill = sum(c.length for c in out.prefill)
        num_vision = sum(c.vision_tokens for c in out.prefill)
        first = sum(len(c.sample_row_ids) for c in out.prefill)
        log.debug("step %d: %d decode rows, %d prompt tokens in %s, %d tower units: %.3f s",
                  out.step, len(out.decode_row_ids), num_prefill, _pieces(out), num_vision,
                  seconds)  # fmt: skip
        self.step_times.observe(out.kind, seconds, bool(traced))
        if out.decode_row_ids and seconds >= self._slow_seconds(len(out.decode_row_ids)):
            self._slow_step(out, seconds, num_prefill, traced, done)
        if traced:
            self.step_cost.advance(done)
            return
        if not settled:
            return
        rows = len(out.decode_row_ids)
        if not out.verify_row_ids:
            self.step_cost.observe(rows, num_prefill, seconds, num_vision, done, first)
            return
        # a step that verified is no sample of the cost model's kinds; without prompt
        # work it prices a verify (Speculation.break_even) against a plain step
        self.step_cost.advance(done)
        total = rows + len(out.verify_row_ids)
        if not out.prefill and self.step_cost.is_ready and self.step_cost.knows_decode(total):
            assert self.speculation is not None, "a verify step without speculation"
            plain = self.step_cost.decode_seconds(total)
            self.speculation.observe_step(rows, len(out.verify_row_ids), seconds, plain)

    def _slow_seconds(self, rows: int) -> float:
        """A step with `rows` decode rows is slow from SLOW_STEP_SECONDS, or SLOW_STEP_FACTOR
        x a decode step of those rows where that is longer (a CPU's steps are ~0.1 s)."""
        if not (self.step_cost.is_ready and self.step_cost.knows_decode(rows)):
            return SLOW_STEP_SECONDS
        return max(SLOW_STEP_SECONDS, SLOW_STEP_FACTOR * self.step_cost.decode_seconds(rows))

    def _slow_step(
        self, out: StepPlan, seconds: float, num_prefill: int, traced: int, done: float
    ) -> None:
        """An INFO line for a slow step with decode rows (`_slow_seconds`: each of them
        waited that long for its token): each one that traced compiled shapes, others at
        most one per SLOW_STEP_EVERY seconds with a count of those not logged since."""
        if not traced and done - self._slow_said < SLOW_STEP_EVERY:
            self._slow_unsaid += 1
            return
        if traced:
            cause = f"; it traced {traced} new compiled shape(s)"
        else:
            unsaid = self._slow_unsaid
            cause = f" ({unsaid} more slow steps since the last)" if unsaid else ""
            self._slow_said, self._slow_unsaid = done, 0
        log.info("step %d took %.2f s: %d decode rows, %d prompt tokens in %s%s", out.step,
                 seconds, len(out.decode_row_ids), num_prefill, _pieces(out), cause)  # fmt: skip

    def _promote(self, req: Request) -> None:
        """Prefill done: the request and its forks join the decode batch (a choice that
        already finished on its first token stays out; forks still copy its state)."""
        st = self.state
        if req in st.prefilling:
            st.prefilling.remove(req)
        if not req.is_finished:  # else the row table gave back all of it, this part too
            self.budget.release(req.prefill_reserved)
            req.reserved_bytes -= req.prefill_reserved
        req.prefill_reserved = 0
        for child in req.children:
            if child.is_finished:
                continue
            child.num_computed = req.num_computed
            child.status = Status.RUNNING
            st.forks.append((child.row_id, req.row_id))
        st.decoding.extend(r for r in (req, *req.children) if not r.is_finished)

    def _append(
        self,
        req: Request,
        tokens: tuple[int, ...],
        logprobs: tuple[TokenLogprob | None, ...],
    ) -> RequestOutput:
        """A row's new tokens (one, or a speculating row's run), appended in order until
        one finishes the row (the rest are dropped); their delta."""
        count, reason = 0, None
        for token in tokens:
            req.output_ids.append(token)
            count += 1
            reason = req.finish_check(token)
            if reason is not None:
                self._finish(req, reason)
                break
        kept = logprobs[:count]
        lps = None if any(lp is None for lp in kept) else kept
        return req.delta(tokens[:count], lps, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """End a choice: the row table releases all it holds (RowTable.release), and it
        leaves the queues. The one way a choice ends: finish, abort and fail_all."""
        st = self.state
        req.status, req.finish_reason = Status.FINISHED, reason
        if req.num_drafted:
            log.debug("%s: %d of %d drafts accepted", req.row_id, req.num_accepted, req.num_drafted)
        st.table.release(req)
        if req in st.decoding:
            st.decoding.remove(req)
        if req in st.prefilling and req not in self._promote_next:
            st.prefilling.remove(req)
            # Forks that will never get their parent's prefilled state die with it.
            for child in req.children:
                if not child.is_finished:
                    self._finish(child, reason, error)
        return req.delta((), None, reason, error)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every row and queued request with an error (the step raised; the engine
        drops every row state with it: ModelRunner.reset, so nothing is left to free)."""
        st = self.state
        victims = list(self.rows.values()) + [r for w in st.waiting for r in (w, *w.children)]
        st.waiting.clear()
        self._timer = StepTimer()
        if self.prefix is not None:
            self.prefix.forget()  # its arrays went with the row states
        # All reservations at once: the accounting may be broken, and this must not raise.
        for req in victims:
            req.reserved_bytes = req.prefill_reserved = 0
        outputs = [self._finish(r, "error", error) for r in victims if not r.is_finished]
        st.table.forget_workers()
        st.prefilling, st.decoding, self._pending, self._promote_next = [], [], {}, []
        self._verify_in_flight = None
        st.clear_plan()
        return outputs


def _pieces(out: StepPlan) -> str:
    """The step's prompt chunks for a log line: how many, how many of them later chunks
    (from past a prompt's start: over the row's state, a prefix-cache hit's included),
    and the longest (on a GPU each chunk group pays a forward's fixed part)."""
    later = sum(c.start > 0 for c in out.prefill)
    longest = max((c.length for c in out.prefill), default=0)
    return f"{len(out.prefill)} chunks ({later} later, longest {longest})"


def _positions(rows: list[Request]) -> tuple[int, ...]:
    """Each row's next input's rotary position."""
    return tuple(r.num_computed + r.rope_delta for r in rows)
