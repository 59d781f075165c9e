"""The prefill half of the scheduler's policy: admission, who prefills how much, and
where a chunk ends. Pure Python, as the scheduler (engine/scheduling/scheduler.py) it is part of.

Two plans. The usual one (`_plan_prefill`) hands a step's prefill allowance to the
prompts, oldest first, next to the decode rows. The other (`_plan_jump`) runs prompts that
can finish at once in a prefill-only step ahead of the decode rows, when the cost model
says that step fits in what the rows may wait: a short prompt (a chat's next turn on a
cached history, a tool call's result) then gets its first token without waiting for the
decode rows' own step on top of its prefill. Measured on the CPU (small shape, 32 rows
decoding, decode steps ~0.064-0.1 s): a 58-token warm turn packed next to the rows took
a 0.096-0.116 s step; run ahead, 0.047-0.055 s. The rows' gap is the jump plus their next
step, whose prefill is cut by the jump's predicted cost (StepCostModel.prefill_allowance's
`spent`), and there is never a jump after a jump.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from deltaserve.engine.cache.budget import MemoryBudget
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.plan import NewRow, PrefillChunk, VisionWork
from deltaserve.engine.prefix_cache.index import CacheSave, PrefixIndex
from deltaserve.engine.request import Request, Status
from deltaserve.engine.scheduling.step_cost import MIN_CHUNK, StepCostModel
from deltaserve.engine.vision.media import VisionPrice, VisionProgress

# Smallest prefill a step with decode rows gets (so prefill always progresses), and the
# smallest slice the prefill allowance is split into (so it is not spread over tiny groups).
MIN_PREFILL_TOKENS = MIN_CHUNK


class PrefillPlanning:
    """Admission and chunking, mixed into Scheduler (which owns these attributes)."""

    config: EngineConfig
    budget: MemoryBudget
    prefix: PrefixIndex | None
    step_cost: StepCostModel
    waiting: deque[Request]
    prefilling: list[Request]
    decoding: list[Request]
    rows: dict[str, Request]
    snapshot_in_chunk: bool
    _new_rows: list[NewRow]
    _saves: list[CacheSave]
    _price: VisionPrice
    _ahead_seconds: float  # predicted cost of the jump just planned (0: none)

    def _plan_jump(self) -> list[PrefillChunk]:
        """Every prompt there is to prefill, in a prefill-only step ahead of the decode
        rows, if each one finishes there and the step fits in the rows' stall allowance;
        else [] (as when the costs are not known yet, or the last step was a jump). The
        rows' next step has what is left of the allowance (a prompt arriving meanwhile
        gets at least MIN_PREFILL_TOKENS there, as in every step). All or none: a
        prefill-only step has fixed costs a chunk next to the rows does not (CPU: the LM
        head's weights read for one row), so it is no gain for the rows, only for the
        prompts whose first token it brings forward; a long prompt still prefilling gets
        the allowance of every step next to the rows, not what is left after jumps."""
        cost, factor = self.step_cost, self.config.max_stall_factor
        rows = len(self.decoding)
        if not (factor and rows) or self._ahead_seconds or not cost.is_ready:
            return []
        if not cost.knows_decode(rows) or cost.alone_seconds(0) is None:
            return []
        limit = cost.stall_seconds(rows, factor)
        plan: list[Request] = []
        tokens = 0
        for req in list(self.prefilling):
            if not self._fits_ahead(req, tokens, limit):
                return []
            plan.append(req)
            tokens += _rest(req)
        while self.waiting and self._can_admit(self.waiting[0]):
            req = self._admit(self.waiting.popleft())
            if not self._fits_ahead(req, tokens, limit):
                return []  # it prefills next to the rows, as do the others
            plan.append(req)
            tokens += _rest(req)
        if not plan:
            return []
        self._ahead_seconds = cost.alone_seconds(tokens)
        return [self._chunk(req, _rest(req), False) for req in plan]

    def _fits_ahead(self, req: Request, tokens: int, limit: float) -> bool:
        """Whether `req` can join a prefill-only step of `tokens` within `limit` seconds."""
        tokens += _rest(req)
        if not self._can_jump(req) or tokens > self.config.max_num_batched_tokens:
            return False
        return self.step_cost.alone_seconds(tokens) <= limit

    def _can_jump(self, req: Request) -> bool:
        """Whether `req`'s whole rest runs as one chunk that samples: no tower work, and
        no snapshot before its end that would cut the chunk (_chunk keeps at most one
        inside it, where the forward can: snapshot_in_chunk)."""
        inner = [p for p in req.snapshot_at if p < req.num_prompt]
        one_chunk = len(inner) <= (1 if self.snapshot_in_chunk else 0)
        whole = 0 < _rest(req) <= self.config.max_prefill_chunk
        return req.media is None and one_chunk and whole

    def _plan_prefill(self, allowance: int) -> list[PrefillChunk]:
        """Hand `allowance` out oldest first (prefilling, then waiting requests admitted
        now). A prompt that can finish takes all it needs: prompts arriving together
        finish in arrival order, in few pieces (each is a group; on the GPU a group costs
        its op count). The oldest, if it cannot finish, takes half while another could
        follow (a long prompt never holds the allowance against short ones); the first
        later prompt that cannot finish takes the rest and ends the plan. The oldest
        always advances; no later one gets below min(its need, MIN_PREFILL_TOKENS)."""
        plan: list[tuple[Request, int]] = []
        left = allowance
        candidates = list(self.prefilling)  # _admit appends to self.prefilling
        while left > 0:
            if candidates:
                req = candidates.pop(0)
            elif self._admissible(left, first=not plan):
                req = self._admit(self.waiting.popleft())
            else:
                break
            demand = self._prefill_demand(req)
            rest = req.num_prompt - req.num_computed
            fits = rest + self._vision_cost(req, req.num_prompt) <= left  # it can finish now
            share = min(demand, left)
            if not fits and not plan and (candidates or self.waiting):
                share = min(share, max(left // 2, MIN_PREFILL_TOKENS))  # room for the next
            if plan and share < min(demand, MIN_PREFILL_TOKENS):
                break
            plan.append((req, share))
            left -= share
            if len(plan) > 1 and not fits:
                break
        if plan and left:  # what the halving left unused goes back to the oldest
            req, share = plan[0]
            plan[0] = (req, min(self._prefill_demand(req), share + left))
        chunks = [self._chunk(req, share, i == 0) for i, (req, share) in enumerate(plan)]
        return [c for c in chunks if c.length or c.vision or c.restore]

    def _admissible(self, left: int, first: bool) -> bool:
        """Whether the oldest waiting request can be admitted and given a slice now."""
        if not (self.waiting and self._can_admit(self.waiting[0])):
            return False
        need = min(self._prefill_demand(self.waiting[0]), MIN_PREFILL_TOKENS)
        return first or need <= left

    def _prefill_demand(self, req: Request) -> int:
        """Prefill tokens (and tower passes, in token equivalents) of the next chunk."""
        tokens = min(req.num_prompt - req.num_computed, self.config.max_prefill_chunk)
        return tokens + self._vision_cost(req, req.num_computed + tokens)

    def _vision_cost(self, req: Request, end: int) -> int:
        """Prefill tokens (at this step's price) of the tower blocks `req` still needs
        before position `end`."""
        return req.media.cost(req.vision, end, self._price) if req.media is not None else 0

    def _chunk(self, req: Request, budget: int, oldest: bool) -> PrefillChunk:
        """The next chunk of `req`, ending at its next snapshot position if it gets there
        (the row's state is saved right after the chunk), or past it with the snapshot
        inside (snapshot_in_chunk). With images: tokens stop at an image whose tower has
        not finished; its blocks take what the budget affords."""
        length = min(req.num_prompt - req.num_computed, budget, self.config.max_prefill_chunk)
        end = req.num_computed + length
        work: tuple[VisionWork, ...] = ()
        if req.media is not None:
            stop = req.num_computed + min(req.num_prompt - req.num_computed, budget)
            stop = min(stop, req.num_computed + self.config.max_prefill_chunk)
            end, work, req.vision = req.media.plan(
                req.vision, req.num_computed, stop, budget, oldest, self._price
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

    def _save(self, req: Request, position: int, inside: bool = False) -> int:
        """Snapshot `req`'s row at `position` with this step's chunk (`inside` it: the
        forward keeps the state there); the position, 0 if cached already or no room."""
        save = self.prefix.insert(req.row_id, req.key_ids, position) if self.prefix else None
        if save is None:
            return 0
        self._saves.append(replace(save, inside=inside))
        return position

    def _can_admit(self, req: Request) -> bool:
        rows = 1 + len(req.children)
        if len(self.rows) + rows > self.config.max_num_seqs:
            return False
        new = (req, *req.children)
        need = sum(self.budget.row_bytes(r.max_total_tokens()) for r in new)
        need += self.budget.padding_bytes(self._lengths(*new)) - self.budget.padding
        need += req.vision_bytes
        if self.prefix is not None:
            return self.prefix.evict_for(need)  # rows come before cached prefixes
        return self.budget.can_reserve(need)

    def _lengths(self, *joining: Request) -> list[int]:
        """Worst-case tokens of every running row (and `joining`): what padding costs."""
        return [r.max_total_tokens() for r in (*self.rows.values(), *joining)]

    def _admit(self, req: Request) -> Request:
        prompt_ids = tuple(req.prompt_ids)  # one tuple for every choice
        for r in (req, *req.children):
            self._new_rows.append(NewRow(r.row_id, prompt_ids, r.params, r.index, r.media))
            r.reserved_bytes = self.budget.row_bytes(r.max_total_tokens())
            self.budget.reserve(r.reserved_bytes)
            r.status = Status.FORKED if r is not req else Status.RUNNING
            self.rows[r.row_id] = r
        req.vision_reserved = req.vision_bytes  # released when the prefill ends
        req.reserved_bytes += req.vision_reserved
        self.budget.reserve(req.vision_reserved)
        self.budget.padding = self.budget.padding_bytes(self._lengths())
        if self.prefix is not None:
            hit = self.prefix.match(req.key_ids, req.prefix_hint)
            req.num_computed = req.num_cached = hit.tokens
            req.cache_chain, req.snapshot_at = hit.chain, list(hit.snapshot_at)
            for child in req.children:
                child.num_cached = hit.tokens
        if req.media is not None:
            req.vision = VisionProgress(req.media.first_needed(req.num_computed))
        self.prefilling.append(req)
        return req


def _rest(req: Request) -> int:
    """Prompt tokens `req` has still to prefill."""
    return req.num_prompt - req.num_computed
