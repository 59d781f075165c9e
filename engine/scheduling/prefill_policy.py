"""The prefill half of the scheduler's policy, as objects the scheduler composes over its
one SchedulerState: Admission (who gets a row), Chunking (who prefills how much, and
where a chunk ends), RunAhead (prompts in a step of their own, ahead of the decode rows)
and StallBound (how much prefill a step next to decode rows may hold). Pure Python, as
the scheduler (engine/scheduling/scheduler.py).

Two plans. The usual one (`Chunking.plan`) hands a step's prefill allowance to the
prompts, oldest first, next to the decode rows. The other (`RunAhead.plan`) runs prompts that
can finish at once in a prefill-only step ahead of the decode rows, when the cost model
says that step fits in what the rows may wait: a short prompt (a chat's next turn on a
cached history, a tool call's result) then gets its first token without waiting for the
decode rows' own step on top of its prefill. Measured on the CPU (small shape, 32 rows
decoding, decode steps ~0.064-0.1 s): a 58-token warm turn packed next to the rows took
a 0.096-0.116 s step; run ahead, 0.047-0.055 s. The rows' gap is the jump plus their next
step, whose prefill is cut by the jump's predicted cost (StepCostModel.prefill_allowance's
`spent`), and there is never a jump after a jump. Where decode steps pipeline (a GPU), the
jump also drains the rows' pipeline, and is priced with a decode step more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from deltaserve.engine.cache.budget import MemoryBudget
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.plan import NewRow, PrefillChunk, VisionWork
from deltaserve.engine.prefix_cache.index import PrefixIndex
from deltaserve.engine.request import Request, Status
from deltaserve.engine.scheduling.state import SchedulerState
from deltaserve.engine.scheduling.step_cost import MIN_CHUNK, StepCostModel
from deltaserve.engine.shapes import chunk_bucket, cohort_splits, prefill_columns
from deltaserve.engine.vision.media import VisionPrice, VisionProgress

log = logging.getLogger(__name__)

# Smallest prefill a step with decode rows gets (so prefill always progresses), and the
# smallest slice the prefill allowance is split into (so it is not spread over tiny groups).
MIN_PREFILL_TOKENS = MIN_CHUNK
# A prompt backlog this many steps' allowance deep is logged, at most every BACKLOG_EVERY s
BACKLOG_STEPS = 8
BACKLOG_EVERY = 30.0


class Chunking:
    """Who prefills how much this step, and where each chunk ends."""

    def __init__(
        self,
        state: SchedulerState,
        config: EngineConfig,
        prefix: PrefixIndex | None,
        snapshot_in_chunk: bool,
        whole_prompts: bool = False,
        traced_lengths: bool = False,
        group_tokens: int = 0,
    ) -> None:
        """group_tokens: what a prompt chunk group's fixed part costs, in tokens (where it
        was measured, a GPU; 0 elsewhere): a step's allowance pays it for each group
        beyond the first (`_group_charge`), so a step of several groups costs what the
        step-cost model priced (one fixed part and its tokens) rather than a fixed part
        more for each (H100, 0.8B: mixed steps of 61 ms mean against the ~25 ms promised).
        snapshot_in_chunk: a forward can keep DeltaNet state mid-chunk (an eager core),
        so a prefix-cache snapshot need not end the chunk. whole_prompts: a fresh text
        prompt that fits one chunk but not what is left of this step waits for the next
        step instead of starting with the leftover: its rest would be a later chunk,
        which pays a second fixed cost for a few hundred tokens, and on a GPU often an
        eager one (a shape not traced yet runs eagerly next to decoding rows: H200,
        0.8B, ~17 ms fixed against ~9 for a compiled first chunk). traced_lengths: prompt
        chunks run compiled at a bucketed length (engine/shapes.py), so a chunk that does
        not finish its prompt takes its whole bucket (`_traced_length`)."""
        self.state = state
        self.config = config
        self.prefix = prefix
        self.snapshot_in_chunk = snapshot_in_chunk
        self.whole_prompts = whole_prompts
        self.traced_lengths = traced_lengths
        self.group_tokens = group_tokens

    def plan(self, allowance: int, admission: Admission) -> list[PrefillChunk]:
        """Hand `allowance` out oldest first (prefilling, then waiting requests admitted
        now). A prompt that can finish takes all it needs: prompts arriving together
        finish in arrival order, in few pieces (each is a group; on the GPU a group costs
        its op count). The oldest, if it cannot finish, takes half while another could
        follow (a long prompt never holds the allowance against short ones); the first
        later prompt that cannot finish takes the rest and ends the plan. The oldest
        always advances; no later one gets below min(its need, MIN_PREFILL_TOKENS), and
        one that starts a group of its own pays `_group_charge` out of what is left."""
        plan: list[tuple[Request, int]] = []
        left = allowance
        candidates = list(self.state.prefilling)  # admit appends to state.prefilling
        while left > 0:
            if candidates:
                req = candidates.pop(0)
            elif self.state.waiting and admission.admissible(
                left - self._group_charge(self.state.waiting[0], plan), first=not plan
            ):
                req = admission.admit(self.state.waiting.popleft())
            else:
                break
            charge = self._group_charge(req, plan)
            room = left - charge
            demand = self.demand(req)
            rest = req.num_prompt - req.num_computed
            fits = rest + self.vision_cost(req, req.num_prompt) <= room  # it can finish now
            share = max(min(demand, room), 0)
            if not fits and not plan and (candidates or self.state.waiting):
                share = min(share, max(left // 2, MIN_PREFILL_TOKENS))  # room for the next
            if plan and share < min(demand, MIN_PREFILL_TOKENS):
                break
            if plan and not fits and self._waits_whole(req):
                break
            plan.append((req, share))
            left -= share + charge
            if len(plan) > 1 and not fits:
                break
        if plan and left:  # what the halving left unused goes back to the oldest
            req, share = plan[0]
            plan[0] = (req, min(self.demand(req), share + left))
        chunks = [self.chunk(req, share, i == 0) for i, (req, share) in enumerate(plan)]
        return [c for c in chunks if c.length or c.vision or c.restore]

    def _group_charge(self, req: Request, plan: list[tuple[Request, int]]) -> int:
        """Tokens `req`'s chunk costs this step beyond its own: group_tokens where it
        starts a group of its own (a later chunk; the step's first fresh prompt where
        the plan already has a later chunk; a fresh prompt whose whole length would
        split the fresh prompts' compiled call in two, engine/shapes.py cohort_splits),
        0 for the plan's first chunk and for a fresh prompt that joins the fresh
        prompts' call. Uncharged, such a split gave a step two fixed parts where the
        allowance priced one (H100, 0.8B, 64 clients: 12 of 93 mixed steps, each slower
        than the median mixed step)."""
        if not self.group_tokens or not plan:
            return 0
        fresh = [share for r, share in plan if _fresh(r)]
        if not (_fresh(req) and fresh):
            return self.group_tokens
        area = self.config.max_prefill_chunk
        calls = len(cohort_splits(fresh, area))
        return self.group_tokens * (len(cohort_splits([*fresh, _rest(req)], area)) - calls)

    def _waits_whole(self, req: Request) -> bool:
        """Whether `req`, which cannot finish in what is left of this step, waits to run
        as one first chunk (whole_prompts): a text prompt not started, from position 0
        (the compiled forward's case), that fits a chunk."""
        fresh = req.num_computed == 0 and req.media is None
        return self.whole_prompts and fresh and req.num_prompt <= self.config.max_prefill_chunk

    def demand(self, req: Request) -> int:
        """Prefill tokens (and tower passes, in token equivalents) of the next chunk."""
        tokens = min(req.num_prompt - req.num_computed, self.config.max_prefill_chunk)
        return tokens + self.vision_cost(req, req.num_computed + tokens)

    def vision_cost(self, req: Request, end: int) -> int:
        """Prefill tokens (at this step's price) of the tower blocks `req` still needs
        before position `end`."""
        return req.media.cost(req.vision, end, self.state.price) if req.media is not None else 0

    def chunk(self, req: Request, budget: int, oldest: bool) -> PrefillChunk:
        """The next chunk of `req`, ending at its next snapshot position if it gets there
        (the row's state is saved right after the chunk), or past it with the snapshot
        inside (snapshot_in_chunk). With images: tokens stop at an image whose tower has
        not finished; its blocks take what the budget affords."""
        rest = req.num_prompt - req.num_computed
        length = self._traced_length(min(rest, budget, self.config.max_prefill_chunk), rest)
        end = req.num_computed + length
        work: tuple[VisionWork, ...] = ()
        if req.media is not None:
            stop = req.num_computed + min(req.num_prompt - req.num_computed, budget)
            stop = min(stop, req.num_computed + self.config.max_prefill_chunk)
            end, work, req.vision = req.media.plan(
                req.vision, req.num_computed, stop, budget, oldest, self.state.price
            )
            length = end - req.num_computed
        inside = 0
        if self.snapshot_in_chunk and req.snapshot_at and req.snapshot_at[0] < end:
            inside = self._save(req, req.snapshot_at.pop(0), inside=True)
        if req.snapshot_at and end >= req.snapshot_at[0]:
            end = req.snapshot_at.pop(0)
            length = end - req.num_computed
            self._save(req, end)
        is_last = end == req.num_prompt
        samplers = (req.row_id, *(c.row_id for c in req.children)) if is_last else ()
        cost = sum((w.stop - w.start) * req.media.block_tokens[w.image] for w in work)
        split = inside - req.num_computed if inside else 0
        chunk = PrefillChunk(
            req.row_id, req.num_computed, length, samplers, req.cache_chain, work, cost, split
        )
        req.cache_chain = ()
        return chunk

    def _traced_length(self, length: int, rest: int) -> int:
        """With traced_lengths, a chunk of `length` of the `rest` tokens a prompt still
        needs grows to its bucket when it does not finish the prompt: the compiled forward
        computes the bucket's columns anyway, and in a later chunk its padding would stay
        in the row's KV as left padding for the rest of its life (columns every decode
        step reads past, and more than its memory reservation). So only a prompt's last
        chunk pads. Never beyond the rest or max_prefill_chunk: the step may then hold up
        to LENGTH_STEP - 1 tokens more than its share, the padding it computed before."""
        if not self.traced_lengths or length >= rest:
            return length
        grown = min(chunk_bucket(length), rest)
        return grown if grown <= self.config.max_prefill_chunk else length

    def _save(self, req: Request, position: int, inside: bool = False) -> int:
        """Snapshot `req`'s row at `position` with this step's chunk (`inside` it: the
        forward keeps the state there); the position, 0 if cached already or no room."""
        save = self.prefix.insert(req.row_id, req.key_ids, position) if self.prefix else None
        if save is None:
            return 0
        self.state.saves.append(replace(save, inside=inside))
        return position


class Admission:
    """Who gets a row: FIFO, bounded by max_num_seqs and the memory budget."""

    def __init__(
        self,
        state: SchedulerState,
        config: EngineConfig,
        budget: MemoryBudget,
        prefix: PrefixIndex | None,
        chunking: Chunking,
        compiled_chunks: bool = False,
    ) -> None:
        """compiled_chunks: a prompt's later chunks run compiled, at a KV capacity bucket
        (`prefill_bytes`)."""
        self.state = state
        self.config = config
        self.budget = budget
        self.prefix = prefix
        self.chunking = chunking
        self.compiled_chunks = compiled_chunks

    def can_admit(self, req: Request) -> bool:
        """Whether `req` and its forks fit the row limit and the memory budget (the
        prefix cache gives way to rows)."""
        rows = 1 + len(req.children)
        if len(self.state.table) + rows > self.config.max_num_seqs:
            return False
        new = (req, *req.children)
        need = sum(self.budget.row_bytes(r.max_total_tokens(), r.speculative) for r in new)
        need += self.budget.padding_bytes(self.state.table.lengths(*new)) - self.budget.padding
        need += self.prefill_bytes(req)
        if self.prefix is not None:
            return self.prefix.evict_for(need)  # rows come before cached prefixes
        return self.budget.can_reserve(need)

    def prefill_bytes(self, req: Request) -> int:
        """Memory `req`'s row holds only while its prompt is prefilled, reserved with it
        and released when the prefill ends: the vision tower's activations, and with
        compiled later chunks the KV capacity bucket the row's store runs at beyond its
        own reservation (engine/shapes.py's prefill_columns; up to 2x a short prompt's
        KV, at most 8,192 columns more for a long one). A row that speculates runs its
        chunks eagerly (the MTP head reads every position), at its own capacity."""
        extra = req.vision_bytes
        if self.compiled_chunks and req.media is None and not req.speculative:
            columns = prefill_columns(req.num_prompt) - req.max_total_tokens()
            extra += max(0, columns) * self.budget.costs.kv_bytes_per_token
        return extra

    def admissible(self, left: int, first: bool) -> bool:
        """Whether the oldest waiting request can be admitted and given a slice now."""
        if not (self.state.waiting and self.can_admit(self.state.waiting[0])):
            return False
        need = min(self.chunking.demand(self.state.waiting[0]), MIN_PREFILL_TOKENS)
        return first or need <= left

    def admit(self, req: Request) -> Request:
        """Give `req` and its forks rows (the tower's memory too, until its prefill ends)
        and start its prefill where the prefix cache has it."""
        prompt_ids = tuple(req.prompt_ids)  # one tuple for every choice
        for r in (req, *req.children):
            new = NewRow(r.row_id, prompt_ids, r.params, r.index, r.media, r.speculative)
            self.state.new_rows.append(new)
            r.status = Status.FORKED if r is not req else Status.RUNNING
        req.prefill_reserved = self.prefill_bytes(req)  # released when the prefill ends
        self.state.table.add((req, *req.children), req.prefill_reserved)
        if self.prefix is not None:
            hit = self.prefix.match(req.key_ids, req.prefix_hint)
            req.num_computed = req.num_cached = hit.tokens
            req.cache_chain, req.snapshot_at = hit.chain, list(hit.snapshot_at)
            for child in req.children:
                child.num_cached = hit.tokens
        if req.media is not None:
            req.vision = VisionProgress(req.media.first_needed(req.num_computed))
        self.state.prefilling.append(req)
        return req


class RunAhead:
    """Prompts that can finish at once, in a prefill-only step ahead of the decode rows,
    when the cost model says it fits in what the rows may wait."""

    def __init__(
        self,
        state: SchedulerState,
        config: EngineConfig,
        step_cost: StepCostModel,
        admission: Admission,
        chunking: Chunking,
        pipelined: bool = False,
    ) -> None:
        """pipelined: the engine queues a decode step before reading the last one back
        (EngineConfig.pipeline_steps). A jump runs in lockstep, so the rows' pipeline
        drains: their next step's tokens come back only after the step after it is
        built, and the jump costs them about a decode step more than in lockstep
        (bench/README.md, "A prompt run ahead of pipelined rows")."""
        self.state = state
        self.config = config
        self.step_cost = step_cost
        self.admission = admission
        self.chunking = chunking
        self.pipelined = pipelined

    def plan(self) -> list[PrefillChunk]:
        """Every prompt there is to prefill, in a prefill-only step ahead of the decode
        rows, if each one finishes there and the step fits in the rows' stall allowance;
        else [] (as when the costs are not known yet, or the last step was a jump). The
        rows' next step has what is left of the allowance (a prompt arriving meanwhile
        gets at least MIN_PREFILL_TOKENS there, unless the chunk cost was measured and no
        chunk fits what the jump left: that step then holds no prompt work). All or none: a
        prefill-only step has fixed costs a chunk next to the rows does not (CPU: the LM
        head's weights read for one row), so it is no gain for the rows, only for the
        prompts whose first token it brings forward; a long prompt still prefilling gets
        the allowance of every step next to the rows, not what is left after jumps."""
        cost, factor = self.step_cost, self.config.max_stall_factor
        rows = len(self.state.decoding)
        if not (factor and rows) or self.state.ahead_seconds or not cost.is_ready:
            return []
        if not cost.knows_decode(rows) or cost.alone_seconds(0) is None:
            return []
        limit = cost.stall_seconds(rows, factor)
        if self.pipelined:  # the rows' pipeline refills after the jump
            limit -= cost.decode_seconds(rows)
            if limit <= 0:
                return []
        plan: list[Request] = []
        tokens = 0
        for req in list(self.state.prefilling):
            if not self._fits_ahead(req, tokens, limit):
                return []
            plan.append(req)
            tokens += _rest(req)
        while self.state.waiting and self.admission.can_admit(self.state.waiting[0]):
            req = self.admission.admit(self.state.waiting.popleft())
            if not self._fits_ahead(req, tokens, limit):
                return []  # it prefills next to the rows, as do the others
            plan.append(req)
            tokens += _rest(req)
        if not plan:
            return []
        self.state.ahead_seconds = cost.alone_seconds(tokens)
        return [self.chunking.chunk(req, _rest(req), False) for req in plan]

    def _fits_ahead(self, req: Request, tokens: int, limit: float) -> bool:
        """Whether `req` can join a prefill-only step of `tokens` within `limit` seconds."""
        tokens += _rest(req)
        if not self._can_jump(req) or tokens > self.config.max_num_batched_tokens:
            return False
        return self.step_cost.alone_seconds(tokens) <= limit

    def _can_jump(self, req: Request) -> bool:
        """Whether `req`'s whole rest runs as one chunk that samples: no tower work, and
        no snapshot before its end that would cut the chunk (Chunking.chunk keeps at most one
        inside it, where the forward can: snapshot_in_chunk)."""
        inner = [p for p in req.snapshot_at if p < req.num_prompt]
        one_chunk = len(inner) <= (1 if self.chunking.snapshot_in_chunk else 0)
        whole = 0 < _rest(req) <= self.config.max_prefill_chunk
        return req.media is None and one_chunk and whole


class StallBound:
    """How much prefill a step next to decode rows may hold: the token budget, or less
    so the step stays within max_stall_factor x a decode-only step (StepCostModel)."""

    def __init__(
        self,
        state: SchedulerState,
        config: EngineConfig,
        step_cost: StepCostModel,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """clock: the scheduler's (for how often a backlog is logged)."""
        self.state = state
        self.config = config
        self.step_cost = step_cost
        self._clock = clock
        self._promise: int | None = None  # allowance last logged as unattainable's
        self._backlog_said = float("-inf")  # when a backlog was last logged (the clock)

    def allowance(self) -> int:
        """Prefill tokens this step: the token budget, or less to bound the decode stall.
        Sets the step's price of tower blocks (in those tokens) as a side effect."""
        decoding = len(self.state.decoding) + self.state.num_draft_tokens
        budget = self.config.max_num_batched_tokens - decoding
        factor = self.factor()
        scale = self.step_cost.vision_scale() if factor else 1.0
        self.state.price = VisionPrice(scale)
        if not factor or not self.state.decoding:
            return budget  # nobody waits on this step: prefill at full speed
        spent = self.state.ahead_seconds  # the rows already waited for a jump
        allowance = self.step_cost.prefill_allowance(len(self.state.decoding), factor, spent)
        if allowance is None:
            return budget  # costs not learned yet
        if not self.step_cost.knows_decode(len(self.state.decoding)):
            return 0  # decode-only steps measure this batch size (StepCostModel)
        self.state.price = VisionPrice(scale, self.step_cost.vision_limit())
        if spent and not allowance and self.step_cost.chunk_cost is not None:
            # measured costs (a GPU): a chunk would stack its fixed part on the jump the
            # rows already waited out, so this step is theirs alone
            return 0
        allowance = min(budget, max(allowance, MIN_PREFILL_TOKENS))
        self._log_promise(allowance, factor)
        self._log_backlog(allowance, budget, factor)
        return allowance

    def factor(self) -> float:
        """This step's stall factor (0: no bound): max_stall_factor, or more while more
        prompts wait for their first token than rows decode. Every stream the step holds
        back, waiting for its first token or its next one, gets an equal share of the
        step's time: with D rows decoding and Q prompts that could prefill, the prompts
        get Q/D of a decode step (a factor of 1 + Q/D). One long prompt next to decoding
        rows keeps the configured bound; a burst of arrivals next to a few decoding rows
        (a server's ramp, a wave of agents' turns) is not admitted a bound's allowance at
        a time, which keeps its last prompts waiting for many steps."""
        base = self.config.max_stall_factor
        rows = len(self.state.decoding)
        if not base or not rows:
            return base or 0.0
        st = self.state
        free = self.config.max_num_seqs - len(st.decoding) - len(st.prefilling)
        queued = len(st.prefilling) + min(len(st.waiting), max(free, 0))
        return max(base, 1.0 + queued / rows)

    def _log_backlog(self, allowance: int, budget: int, factor: float) -> None:
        """Say (at most every BACKLOG_EVERY seconds) when prompts queue behind the bound:
        a burst of arrivals next to decoding rows is admitted at the bound's
        allowance, so its last prompts wait many steps for their first token. The
        operator's choice between smooth streams and that wait is max_stall_factor."""
        st = self.state
        if allowance >= budget or len(st.prefilling) + len(st.waiting) < 2:
            return  # one prompt (however long) advancing at the allowance is the design
        now = self._clock()
        if now - self._backlog_said < BACKLOG_EVERY:
            return  # said lately: no need to count the queue's tokens every step
        tokens = sum(r.num_prompt - r.num_computed for r in st.prefilling)
        tokens += sum(r.num_prompt for r in st.waiting)
        if tokens < BACKLOG_STEPS * allowance:
            return
        self._backlog_said = now
        log.info(
            "%d requests (%d prompt tokens) wait for their first token behind the %.1fx "
            "stall bound, which lets ~%d prompt tokens into each step next to %d decoding "
            "rows (~%d steps to clear them); --max-stall-factor 0 admits them at the token "
            "budget (%d a step), at the cost of longer gaps in the running streams",
            len(st.prefilling) + len(st.waiting), tokens, factor, allowance,
            len(st.decoding), -(-tokens // allowance), budget,
        )  # fmt: skip

    def _log_promise(self, allowance: int, factor: float) -> None:
        """Say once (and again when it changes) that the stall bound cannot be met here,
        and what the steps with prompt work cost instead."""
        if not (self.state.prefilling or self.state.waiting):
            return  # no prompt to advance: nothing is promised this step
        line, last = self.step_cost.unattainable, self._promise
        if line is None:
            if last is not None:
                log.info("prompt chunks fit the %.1fx stall bound again", factor)
            self._promise = None
            return
        if last is not None and last / 2 <= allowance <= 2 * last:
            return  # said already (about this size)
        decode = self.step_cost.decode_seconds(len(self.state.decoding))
        step = decode + line[0] + line[1] * allowance
        log.info(
            "a prompt chunk next to %d decode rows costs a fixed %.1f ms (a decode step "
            "%.1f ms): the %.1fx stall bound cannot be met; prompts advance in chunks of "
            "up to %d tokens, steps of ~%.1f ms (%.1fx)",
            len(self.state.decoding), 1e3 * line[0], 1e3 * decode, factor, allowance,
            1e3 * step, step / decode,
        )  # fmt: skip
        self._promise = allowance


def _fresh(req: Request) -> bool:
    """Whether `req`'s next chunk is a fresh text prompt's first (the runner runs such
    chunks of one step as one group)."""
    return req.num_computed == 0 and req.media is None and not req.cache_chain


def _rest(req: Request) -> int:
    """Prompt tokens `req` has still to prefill."""
    return req.num_prompt - req.num_computed
