"""Which decoding rows speculate each step, and what their drafts earned. Pure Python.

A row may speculate (engine/speculative.py) when its request allows it
(SamplingParams.speculative), greedy or sampled, with logit_bias and penalties and with
a grammar (each verify column's logits are processed with the drafts before it as
output, and masked by the grammar after them), and with a thinking budget except in the
steps whose k + 1 tokens could reach its forced close (SamplingParams.may_force_within:
a verify forces no token, so those steps decode plainly).

A speculating row's step costs a verify of k + 1 tokens (and k head passes) instead of
one decode token; it pays when enough drafts are accepted. How many is the device's
answer, not a constant: `observe_step` takes the time of each step that verified (without
prompt work) against the scheduler's prediction of a plain decode step of the same rows
(StepCostModel), and `break_even` is the drafts a verify must get accepted, on average, to
make up for what it added to the step (with D plain and V verifying rows, a step that
takes S instead of P pays when the V rows' accepted drafts exceed (S - P) / (P / (D + V));
the weighted median over the recent timed steps).
Until COST_SAMPLES such steps are measured the floor is MIN_ACCEPTANCE of the drafts.

Each row keeps its recent verify steps; when they average fewer accepted drafts than the
break-even (or can no longer reach it within WINDOW_STEPS) the row decodes plainly for a
pause and then probes with PROBE_STEPS verifies (its MTP head store misses the plain
steps' positions meanwhile). Pauses end on a grid of PAUSE_STEPS shared by every row, and
where verifies are measured not to pay a new row's first verify waits for it too: rows
that started decoding in different steps probe in one verify step, not one each (a step
of 2-3 verifying rows costs a verify's fixed part, which then also priced the
break-even as if no draft could ever repay it: 0.37x decode at B=64 on an H100).
A failed probe doubles the pause (PAUSE_STEPS up to MAX_PAUSE_STEPS), a good one ends
the back-off. Where the last GLOBAL_STEPS verifies of every row together fell short of
the break-even, a row's verifies are judged as a probe's are (PROBE_STEPS), without a
full window's room to catch up: where drafts land nowhere (random weights), rows that
start together would otherwise each pay most of a window's verifies before pausing, a
share of a short request's steps; a row whose drafts land passes either way. So a
row whose drafts never land (or never land often enough to pay, as on a device where a
verify costs several decode steps) pays at most WINDOW_STEPS verifies
once and then a few per thousand steps, so speculation that cannot win costs about a
plain step.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate

from deltaserve.engine.request import Request

WINDOW_STEPS = 8  # verify steps a row's acceptance rate is measured over
# Below this share of accepted drafts a row stops drafting while the break-even is not
# measured yet (it depends on the device: what a verify adds to a step)
MIN_ACCEPTANCE = 0.3
COST_SAMPLES = 4  # verify steps timed before their measured cost sets the break-even
COST_WINDOW = 32  # the most recent timed verify steps the break-even is measured over
PAUSE_STEPS = 64  # plain decode steps before a row that stopped drafting tries again
MAX_PAUSE_STEPS = 1024  # the longest pause after failed probes (each doubles it)
PROBE_STEPS = 2  # verify steps a retry is judged on
GLOBAL_STEPS = 64  # every row's recent verifies together: short of the break-even, rows
# are judged on a probe's PROBE_STEPS


@dataclass
class _RowRecord:
    """A speculating row's recent verify steps."""

    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    paused_until: int = -1  # step number before which the row decodes plainly
    pause: int = PAUSE_STEPS  # the next pause's length
    probing: bool = False  # a retry after a pause, judged on PROBE_STEPS verifies


@dataclass
class SpeculationStats:
    """Drafts verified and accepted since start (the engine's stats, /metrics)."""

    num_drafted: int = 0
    num_accepted: int = 0


class Speculation:
    """Per-row speculation policy: who drafts this step, and their acceptance."""

    def __init__(self, num_draft: int) -> None:
        self.num_draft = num_draft
        self.stats = SpeculationStats()
        self._rows: dict[str, _RowRecord] = {}
        # per timed verify step: (seconds it took over a plain step, a plain step's
        # seconds per row x its verifying rows)
        self._costs: deque[tuple[float, float]] = deque(maxlen=COST_WINDOW)
        # accepted drafts of the last GLOBAL_STEPS verifies of any row, and their sum
        self._recent: deque[int] = deque(maxlen=GLOBAL_STEPS)
        self._recent_accepted = 0

    def observe_step(
        self, num_decode: int, num_verify: int, seconds: float, plain_seconds: float
    ) -> None:
        """A step without prompt work in which num_verify rows verified beside num_decode
        plain decode rows took `seconds`; a decode-only step of all of them is predicted
        to take plain_seconds."""
        if num_verify <= 0 or plain_seconds <= 0:
            return
        per_row = plain_seconds / (num_decode + num_verify)
        self._costs.append((seconds - plain_seconds, num_verify * per_row))

    def break_even(self) -> float | None:
        """Accepted drafts a verify must average to pay for itself: the time verifies
        added to their steps over the time their rows' plain tokens would have taken,
        each of the last COST_WINDOW timed steps' ratio weighted by those rows' plain
        time (a step with one verifying row among many weighs little), the weighted
        median of them; None until COST_SAMPLES steps are timed. A median, not a ratio
        of sums: one step that waited on something else (a first-use kernel build, the
        server's thread holding the GIL, a collection) would otherwise price every
        verify after it, and rows that pause on it verify too rarely to replace it."""
        if len(self._costs) < COST_SAMPLES:
            return None
        ratios = sorted((extra / unit, unit) for extra, unit in self._costs)
        below = list(accumulate(unit for _, unit in ratios))  # weight up to each ratio
        return max(ratios[bisect_left(below, below[-1] / 2)][0], 0.0)

    def speculates(self, req: Request, step: int, ahead: int = 0) -> bool:
        """Whether `req`'s row drafts in `step`: it may, is not paused, has more than one
        token left to write (a last token gains nothing from drafts), and none of the
        k + 1 it could write is forced (a thinking budget's close); `ahead`: tokens the
        row may have written in a step not read back yet, counted as written."""
        if not req.speculative:
            return False
        if req.params.may_force_within(req.output_ids, self.num_draft + 1 + ahead):
            return False
        left = min(req.params.max_tokens - len(req.output_ids), req.max_context - req.num_tokens)
        left -= ahead
        record = self._rows.get(req.row_id)
        if record is None:
            # a new row where verifies are measured not to pay (no k drafts repay one)
            # waits for the grid its paused peers probe on, so they verify together
            need = self.break_even()
            if need is not None and need >= self.num_draft:
                return left > 1 and step % PAUSE_STEPS == 0
            return left > 1
        return left > 1 and step >= record.paused_until

    def observe(self, req: Request, drafted: int, accepted: int, step: int) -> None:
        """A verify step's outcome for `req`'s row (accepted of drafted)."""
        self.stats.num_drafted += drafted
        self.stats.num_accepted += accepted
        req.num_drafted += drafted
        req.num_accepted += accepted
        record = self._rows.setdefault(req.row_id, _RowRecord())
        record.recent.append((drafted, accepted))
        if len(self._recent) == GLOBAL_STEPS:
            self._recent_accepted -= self._recent[0]  # the one the append drops
        self._recent.append(accepted)
        self._recent_accepted += accepted
        seen = len(record.recent)
        need = self.break_even()
        if need is None:
            need = MIN_ACCEPTANCE * sum(d for d, _ in record.recent) / seen
        window = PROBE_STEPS if record.probing or self._landing_short(need) else WINDOW_STEPS
        landed = sum(a for _, a in record.recent)
        # a window not full yet is judged lost as soon as drafts landing in every verify
        # still to come could not lift it to the break-even (where a verify costs more
        # than k drafts can repay, at once)
        if landed + drafted * max(window - seen, 0) < need * max(window, seen):
            record.recent.clear()
            if record.probing:  # drafts still do not land: wait twice as long
                record.pause = min(2 * record.pause, MAX_PAUSE_STEPS)
            # on a grid shared by every row: rows that paused in different steps probe
            # in the same one, a single verify step (its fixed cost shared by all of
            # them), not one per row's own schedule
            record.paused_until = -(-(step + record.pause) // PAUSE_STEPS) * PAUSE_STEPS
            record.probing = True
        elif record.probing and seen >= window:  # the drafts land again: the full window
            record.probing, record.pause = False, PAUSE_STEPS

    def _landing_short(self, need: float) -> bool:
        """Whether every row's recent verifies together (at least WINDOW_STEPS of them)
        averaged fewer accepted drafts than `need`: a row's own are then judged on a
        probe's few verifies."""
        if len(self._recent) < WINDOW_STEPS:
            return False
        return self._recent_accepted < need * len(self._recent)

    def release(self, row_ids: Iterable[str]) -> None:
        """RowTable's release hook: a finished row's record goes."""
        for row_id in row_ids:
            self._rows.pop(row_id, None)
