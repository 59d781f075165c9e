"""What a step costs on this model and machine, learned from measured step times.

Pure Python (no mx.array): the scheduler asks it how many prefill tokens fit next to the
decode rows without stalling them by more than a set factor, and what a vision-tower
block costs in those tokens. The runs that shaped each rule below are in bench/README.md,
"Why the step-cost model is shaped as it is".

The model: a step with D decode rows, P prefill tokens and V token equivalents of
vision-tower work (PromptMedia.block_tokens: a block's FLOPs over a token's) takes

    t(D, P, V) ~= a + b * D + c * P + v * V

fitted online from the engine's own steps, three kinds of sample kept apart:

- decode-only steps (P = V = 0) give `a + b * D`: a least-squares line through the last
  WINDOW samples, recent ones weighing more (each older sample by DECAY), after dropping
  outliers above OUTLIER x the median of the samples with the same D (a GC pause, a
  first-use compile, an image decoded on the same cores). With no spread in D it is
  the weighted mean (b = 0); b is never negative. The cut is tight because a slow newest
  sample, weighing most, lifts the line and the allowance with it; it is per D so that a
  window of mostly small batches does not cut the large ones.
- steps with decode rows and prompt tokens but no tower work give `c`: each one's
  residual over the decode line, per prefill token; c is the weighted median of those
  (weights: tokens x recency), so one slow step does not shrink the allowance for long.
  The residual absorbs per-group overheads and the attention cost of long contexts at
  the sizes the scheduler actually runs, and moves with them as a prompt's context grows.
  Only the samples of the last MAX_AGE seconds count: older ones were measured at
  another load and, refitted against today's decode line, at batch sizes it may never
  have seen. Below PROBE_TOKENS tokens in the window c is not fitted from prompt tokens
  alone (a residual over a few tokens is the decode step's noise): prompt-token and
  tower samples then share one cost, units alike.
- steps with tower work give `v`: their residuals over the decode line less their
  tokens' c * P, summed, over their token equivalents summed (recency-weighted). Not a
  median: tower steps are few and a block's residual is small next to a step's noise, so
  one lucky step could make blocks look free; a sum errs the safe way, to a higher price.
  `vision_scale` = v / c is what the scheduler multiplies block_tokens by. A block's FLOPs
  are not its cost (a few large matmuls over all of an image's patches, while the small
  chunks next to decode rows pay for reading the weights), so each kind has its own price
  rather than the more frequent one setting the other's.

Tower samples age out like prompt-token samples; decode-only samples do not (while a
long prompt prefills next to decode rows no decode-only step comes, and the line is
still needed). But the line is never extrapolated to a batch size it has not seen
lately: `knows_decode` is false unless a decode-only step of about that many rows
(within ROWS_NEAR) completed in the last MAX_AGE seconds, and the scheduler then runs
decode-only steps until one is measured: one in lockstep (the CPU default, see
EngineConfig.pipeline_steps), four when pipelined (the first two after a lockstep step
are not samples, see StepTimer, and the next plan comes before the third is read back).
Where steps are pipelined a measuring step is not forced into lockstep: the bound is
against pipelined decode steps, and a lockstep step among them also waits for the step
in flight, so it would overstate the line.

A sample's age is from its step's completion to the newest step's (the scheduler's
clock). Samples are kept raw and refitted against the current decode line.
Prefill-only steps are not used: with no decode row the line's intercept is an
extrapolation (with one decode batch size seen, it is that size's time), and they need
no bound. Until there are MIN_SAMPLES decode-only steps, `prefill_allowance` returns
None: no constraint, as without the model. With decode samples but no prefill sample yet
it returns 0 (the scheduler then runs its minimum), and again once they all aged out:
the first prefill next to decode rows is a small probe, and the allowance grows from
what it measured, at most GROWTH x the largest prefill in the window per step (a probe's
residual is mostly noise). Tower work starts the same way on its own: `vision_limit` is
0 before any step with blocks was measured (the scheduler then runs one block, the
oldest prompt's forced advance) and GROWTH x the most seen in one step after: one block
is measured before more run at its price. Without tower samples v = c (scale 1); below
PROBE_TOKENS prompt tokens in the window (none included) c comes from the prompt-token
and tower steps together, tokens and token equivalents counted alike, and v = c.
Where the chunk cost was measured at start (ChunkCost: a GPU), prompt tokens are priced
by that line instead, with no probe and no slow start, and a chunk is never smaller than
the one that repays its fixed part (`_from_measured`); the decode line still sets the
bound.

Prefill-only steps that sample a first token give `alone_seconds(P)` = a0 + c0 * P (as
the decode line, over P; in proportion while flat and past the largest P seen): what a
step of prompts run ahead of the decode rows costs (engine/scheduling/prefill_policy.py). Only steps
that sample count (they pay the LM head, a chunk that samples nothing does not); they do
not age; with none, nothing runs ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.engine.api import HOST_PARTS, STEP_KINDS, STEP_SECONDS_BUCKETS, StepTimes

WINDOW = 32  # samples kept of each kind
DECAY = 0.9  # weight of a sample relative to the next newer one
MIN_SAMPLES = 3  # decode-only steps before the model constrains anything
OUTLIER = 1.5  # decode-only samples above this x their row count's median are ignored
MAX_AGE = 30.0  # seconds: older prompt-token and tower samples are forgotten
GROWTH = 2  # the allowance is at most this x the largest prefill sample in the window
PROBE_TOKENS = 16  # prompt tokens (in the window) before they get a cost of their own
# Smallest prompt chunk a step with decode rows runs (engine/scheduling/prefill_policy.py's
# MIN_PREFILL_TOKENS); an allowance below it means the bound cannot be met as priced.
MIN_CHUNK = 16
ROWS_NEAR = 0.25  # a decode-only sample within this share of D rows (at least 1) knows D
# Of the time a step may add over a decode step, the share the prefill is sized to. The
# bound is on the p99 gap, the model predicts a step's mean: a step sized to exactly the
# bound runs over it as often as decode steps run over their mean.
HEADROOM = 0.85


# A default step's token part costs this many times a chunk's fixed part: the fixed cost
# is at most a fifth of a full step's
TOKENS_PER_FIXED = 4
MIN_BUDGET, MAX_BUDGET, ROUND = 512, 8192, 256


@dataclass(frozen=True)
class ChunkCost:
    """A prompt chunk's forward: `fixed_seconds` + `token_seconds` x its tokens, as
    measured when the engine started (engine/scheduling/chunk_cost.py; None on the CPU).
    `later_fixed_seconds` is the fixed part of a prompt's later chunk (one over the row's
    state: an eager forward where a first chunk may run compiled)."""

    fixed_seconds: float
    token_seconds: float
    later_fixed_seconds: float = 0.0
    # measured beside a decoding row, as what a chunk adds to its step (mixed steps packed)
    beside_decode: bool = False

    @property
    def most_fixed_seconds(self) -> float:
        """The larger fixed part: what a prompt split into chunks pays per chunk."""
        return max(self.fixed_seconds, self.later_fixed_seconds)

    def split_seconds(self, tokens: int) -> float:
        """What a chunk of `tokens` costs at the larger fixed part: the price of a small
        chunk, which a prompt too long for one step pays again for each of its pieces."""
        return self.most_fixed_seconds + self.token_seconds * tokens

    def floor_tokens(self) -> int:
        """Tokens that cost what the larger fixed part does: the smallest chunk that
        repays it."""
        return int(self.most_fixed_seconds / self.token_seconds + 1e-6)

    def budget_tokens(self) -> int:
        """The per-step token budget where the tokens cost TOKENS_PER_FIXED x the fixed
        part (a multiple of ROUND within [MIN_BUDGET, MAX_BUDGET])."""
        tokens = TOKENS_PER_FIXED * self.fixed_seconds / self.token_seconds
        return int(min(max(tokens // ROUND * ROUND, MIN_BUDGET), MAX_BUDGET))


@dataclass(frozen=True)
class StepSample:
    num_decode: int  # decode rows of the step
    num_prefill: int  # prompt tokens of the step
    seconds: float  # measured wall time of the step
    num_vision: int = 0  # vision-tower work of the step, in block_tokens' equivalents
    done: float = 0.0  # when the step completed (the scheduler's clock, seconds)
    first_tokens: int = 0  # rows whose first token the step sampled


class StepCostModel:
    """Online fit of step time = a + b * decode_rows + c * prefill_tokens + v * vision."""

    def __init__(self, chunk_cost: ChunkCost | None = None) -> None:
        """chunk_cost: a prompt chunk's forward as measured at start
        (engine/scheduling/chunk_cost.py): where given, it prices prompt tokens."""
        self.chunk_cost = chunk_cost
        self._decode: deque[StepSample] = deque(maxlen=WINDOW)
        self._prefill: deque[StepSample] = deque(maxlen=WINDOW)  # prompt tokens only
        self._vision: deque[StepSample] = deque(maxlen=WINDOW)  # with tower work
        self._alone: deque[StepSample] = deque(maxlen=WINDOW)  # prefill-only, sampling
        self._line: tuple[float, float] | None = None  # (a, b), refitted lazily
        self._alone_line: tuple[float, float] | None = None  # (a0, c0), refitted lazily
        self._token_cost: float | None = None
        self._vision_cost: float | None = None
        self._now = 0.0  # the newest step's completion (the scheduler's clock)
        # Set by prefill_allowance: (fixed, per-token) seconds of a prompt chunk when the
        # stall bound cannot be met by any chunk and chunks are sized to repay their
        # fixed cost instead (read by the scheduler's log); None while the bound holds
        self.unattainable: tuple[float, float] | None = None

    def observe(
        self,
        num_decode: int,
        num_prefill: int,
        seconds: float,
        num_vision: int = 0,
        done: float = 0.0,
        first_tokens: int = 0,
    ) -> None:
        """Record one step that completed at `done` (ignored if it took no time, or
        decoded nothing and sampled no prompt's first token); prompt-token and tower
        samples older than MAX_AGE seconds before `done` are dropped."""
        self._now = max(self._now, done)
        self._forget_before(done - MAX_AGE)
        if seconds <= 0:
            return
        sample = StepSample(num_decode, num_prefill, seconds, num_vision, done, first_tokens)
        if num_decode == 0:
            if num_prefill and first_tokens and not num_vision:
                self._alone.append(sample)
                self._alone_line = None
            return
        kind = self._vision if num_vision else self._prefill if num_prefill else self._decode
        kind.append(sample)
        self._line = self._token_cost = self._vision_cost = None

    def advance(self, done: float) -> None:
        """A step that is no sample (one that verified drafts) completed at `done`: the
        clock moves on all the same, so samples age as steps run."""
        self._now = max(self._now, done)
        self._forget_before(done - MAX_AGE)

    def _forget_before(self, oldest: float) -> None:
        for kind in (self._prefill, self._vision):
            while kind and kind[0].done < oldest:
                kind.popleft()
                self._token_cost = self._vision_cost = None

    def knows_decode(self, num_decode: int) -> bool:
        """Whether a decode-only step of about `num_decode` rows completed in the last
        MAX_AGE seconds (before the newest step observed): the line may be read there."""
        near = max(1, int(ROWS_NEAR * num_decode))
        return any(
            abs(s.num_decode - num_decode) <= near and s.done >= self._now - MAX_AGE
            for s in self._decode
        )

    @property
    def is_ready(self) -> bool:
        """Enough decode-only samples to predict a decode step."""
        return len(self._decode) >= MIN_SAMPLES

    @property
    def prices_tokens(self) -> bool:
        """Whether a prompt token's cost next to decode rows was measured (in the window)."""
        return bool(self._prefill or self._vision)

    def decode_seconds(self, num_decode: int) -> float:
        """Predicted time of a decode-only step of `num_decode` rows (needs samples)."""
        a, b = self._decode_line()
        return a + b * num_decode

    def token_seconds(self) -> float:
        """Predicted marginal time of one prefill token (needs decode samples and a
        prefill or tower sample)."""
        if self._token_cost is None:
            line = self._decode_line()
            if self._tokens_known():
                self._token_cost = _unit_cost(list(self._prefill), line, _tokens)
            else:  # few prompt tokens measured: they and tower equivalents alike
                mixed = sorted((*self._prefill, *self._vision), key=lambda s: s.done)
                self._token_cost = _unit_cost(mixed, line, _all_units)
        return self._token_cost

    def _tokens_known(self) -> bool:
        """Enough prompt tokens in the window to price them apart from tower work (a
        residual over a few tokens is mostly the decode step's noise)."""
        return sum(s.num_prefill for s in self._prefill) >= PROBE_TOKENS

    def vision_seconds(self) -> float:
        """Predicted marginal time of one token equivalent of tower work (= a token's
        until a step with tower work was measured)."""
        if self._vision_cost is None:
            if not self._vision or not self._tokens_known():
                self._vision_cost = self.token_seconds()
            else:
                self._vision_cost = _tower_cost(
                    list(self._vision), self._decode_line(), self.token_seconds()
                )
        return self._vision_cost

    def vision_scale(self) -> float:
        """What a tower token equivalent costs in prefill tokens (1.0 while unknown)."""
        if not self.is_ready or not (self._prefill or self._vision):
            return 1.0
        return self.vision_seconds() / self.token_seconds()

    def predict(self, num_decode: int, num_prefill: int, num_vision: int = 0) -> float:
        tokens = self.token_seconds() * num_prefill
        return self.decode_seconds(num_decode) + tokens + self.vision_seconds() * num_vision

    def stall_seconds(self, num_decode: int, max_stall_factor: float) -> float:
        """What prompt work may add to the decode rows' gap between two tokens: HEADROOM
        of the bound's extra time over a decode-only step (needs decode samples)."""
        return HEADROOM * (max_stall_factor - 1.0) * self.decode_seconds(num_decode)

    def alone_seconds(self, num_prefill: int) -> float | None:
        """Predicted time of a prefill-only step of `num_prefill` tokens that samples
        its prompts' first tokens; None before such a step was measured. Where the chunk
        cost was measured at start, never below that chunk's price: the few prefill-only
        steps a server runs (its first requests) left a line that priced a 53-token jump
        at under 9.3 ms on an H100 at 9B, where it took 24 ms, and the rows' next step
        held a full chunk on top (a 56 ms gap)."""
        fit = self._alone_fit(num_prefill)
        if fit is None or self.chunk_cost is None:
            return fit
        prior = self.chunk_cost
        return max(fit, prior.fixed_seconds + prior.token_seconds * num_prefill)

    def _alone_fit(self, num_prefill: int) -> float | None:
        """`alone_seconds` from the prefill-only steps seen alone."""
        if not self._alone:
            return None
        if self._alone_line is None:
            self._alone_line = _fit_line(list(self._alone), _tokens)
        a, c = self._alone_line
        if c == 0:
            # Flat (one size seen) would price a 32-token last piece as the 452/512-token
            # steps before it (CPU: 0.42 s): it would never run ahead to be measured.
            tokens = sum(s.num_prefill for s in self._alone)
            return sum(s.seconds for s in self._alone) * num_prefill / tokens
        most = max(s.num_prefill for s in self._alone)
        if num_prefill <= most:
            return a + c * num_prefill
        # Past the largest P seen, in proportion: a bound of any a0 + c0 P, a0, c0 >= 0
        return (a + c * most) * num_prefill / most

    def prefill_allowance(
        self, num_decode: int, max_stall_factor: float, spent: float = 0.0
    ) -> int | None:
        """Prefill tokens (tower work counted at vision_scale) that keep a step with
        `num_decode` rows within `max_stall_factor` x a decode-only step, less HEADROOM's
        margin and `spent` seconds the rows already waited since their last token (a
        prefill-only step run ahead of them); None while the model has too few samples.
        Where the chunk cost was measured at start, from that line (`_from_measured`);
        else from the online fit; where no chunk can meet the bound, either way, chunks
        that repay their fixed cost (`_amortized`); `unattainable` says when none can."""
        self.unattainable = None
        if not self.is_ready:
            return None
        bound = self.stall_seconds(num_decode, max_stall_factor)
        if self.chunk_cost is not None:
            return self._from_measured(self.chunk_cost, bound, spent)
        if not self.prices_tokens:
            return 0
        extra = max(bound - spent, 0.0)
        fit = int(extra / self.token_seconds() + 1e-6)  # not 139 for 139.99999
        # Slow start: at most GROWTH x the largest prefill seen next to decode rows. A
        # small probe's residual is mostly noise (a 3-token chunk can look free), and
        # the fit alone would then hand the next step the whole token budget.
        scale = self.vision_scale()
        seen = max(s.num_prefill + scale * s.num_vision for s in (*self._prefill, *self._vision))
        cap = int(GROWTH * seen + 1e-6)
        if bound / self.token_seconds() < MIN_CHUNK:  # no chunk meets it, `spent` or not
            fit = self._amortized(bound, cap)
        return min(fit, cap)

    def _from_measured(self, prior: ChunkCost, bound: float, spent: float) -> int:
        """The allowance where the chunk cost was measured at start (a GPU): from that
        line, at once, never below the chunk that repays its fixed part (as many tokens as
        the fixed part costs), and without the online fit's probes and slow start. On a
        GPU a small chunk costs about what a large one does, its residual over a noisy
        decode step says little, and its odd lengths are shapes not compiled yet, whose
        first runs stall every stream (bench/README.md, the ninth session's H100 run).
        Where that chunk breaks the bound (`unattainable`), steps hold it and no more: a
        decode step plus twice the fixed part, the least a step that repays its fixed part
        can stall the streams, rather than the whole token budget (steps of ~4-5x a decode
        step, each a gap in every stream). Right after a jump (`spent`) that left less
        room than that chunk, none: the rows' step would stack its fixed part on the jump
        (9B on an H100: a 24 ms jump, then a 370-token chunk's 32 ms step)."""
        floor = prior.floor_tokens()
        fit = int((bound - spent - prior.most_fixed_seconds) / prior.token_seconds + 1e-6)
        if bound < 2 * prior.most_fixed_seconds:  # the floor chunk's step breaks it
            self.unattainable = (prior.most_fixed_seconds, prior.token_seconds)
        if spent and fit < floor:
            return 0  # the rows waited out a jump: their step holds no chunk on top
        return max(floor, fit)

    def _amortized(self, extra: float, cap: int) -> int:
        """The allowance where even MIN_CHUNK tokens break the bound: a prompt chunk that
        pays its fixed cost (a forward's launches on a GPU: a 16-token chunk of the 0.8B
        shape cost about what 256 tokens did) for as many tokens as that cost, or as the
        bound's extra time, buys (`prefill_line`); while the fixed part is unknown (the
        chunks so far were all of one size), a chunk of `cap` to learn it. Sets
        `unattainable` to (fixed, per-token) seconds for the scheduler's log."""
        line = self.prefill_line()
        if line is None:
            return cap
        fixed, token = line
        self.unattainable = line
        return max(MIN_CHUNK, int(max(fixed, extra) / token + 1e-6))

    def prefill_line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds a token) of a prompt chunk next to decode rows: the
        least-squares line of the prompt-token samples' residuals over the decode line,
        on their token counts (no tower work). None while the counts barely varied."""
        if not self.is_ready or len(self._prefill) < 2:
            return None
        a, b = self._decode_line()
        residual = [
            StepSample(0, s.num_prefill, max(s.seconds - a - b * s.num_decode, 0.0), done=s.done)
            for s in self._prefill
        ]
        sizes = {s.num_prefill for s in residual}
        if len(sizes) < 2 or max(sizes) < 2 * min(sizes):
            return None
        fixed, token = _fit_line(residual, _tokens)
        if token <= 0:  # flat: the chunks' cost is all fixed; price a token as the median
            token = self.token_seconds()
        return max(fixed, 0.0), max(token, _floor((a, b)))

    def vision_limit(self) -> int:
        """Most tower work (token equivalents) for one step next to decode rows: GROWTH x
        the most measured in one step, 0 before any (the scheduler's forced block then)."""
        return GROWTH * max((s.num_vision for s in self._vision), default=0)

    def _decode_line(self) -> tuple[float, float]:
        if self._line is None:
            self._line = _fit_line(list(self._decode))
        return self._line


def _weights(n: int) -> list[float]:
    """Recency weights of n samples, oldest first."""
    return [DECAY ** (n - 1 - i) for i in range(n)]


def _medians(samples: list[StepSample], x: Callable[[StepSample], int]) -> dict[int, float]:
    """Median seconds of the samples of each value of x (the upper one of two)."""
    by_x: dict[int, list[float]] = {}
    for s in samples:
        by_x.setdefault(x(s), []).append(s.seconds)
    return {value: sorted(t)[len(t) // 2] for value, t in by_x.items()}


def _rows(s: StepSample) -> int:
    return s.num_decode


def _fit_line(
    samples: list[StepSample], x: Callable[[StepSample], int] = _rows
) -> tuple[float, float]:
    """Weighted least squares of seconds on x (decode rows unless told), outliers
    dropped; b >= 0."""
    median = _medians(samples, x)
    kept = [
        (w, s)
        for w, s in zip(_weights(len(samples)), samples, strict=True)
        if s.seconds <= OUTLIER * median[x(s)]
    ]
    total = sum(w for w, _ in kept)
    mean_x = sum(w * x(s) for w, s in kept) / total
    mean_y = sum(w * s.seconds for w, s in kept) / total
    var_x = sum(w * (x(s) - mean_x) ** 2 for w, s in kept) / total
    cov = sum(w * (x(s) - mean_x) * (s.seconds - mean_y) for w, s in kept) / total
    if var_x < 0.25 or cov <= 0:  # x barely varied, or noise says "more of it, faster"
        return mean_y, 0.0
    b = cov / var_x
    a = mean_y - b * mean_x
    if a < 0:  # the line would go below zero at few rows: proportional instead
        return 0.0, mean_y / mean_x
    return a, b


def _tokens(s: StepSample) -> int:
    return s.num_prefill


def _all_units(s: StepSample) -> int:
    return s.num_prefill + s.num_vision


def _floor(line: tuple[float, float]) -> float:
    """The least a unit costs: never free, so the allowance stays finite."""
    a, b = line
    return 1e-3 * (a + b) + 1e-9


def _unit_cost(
    samples: list[StepSample], line: tuple[float, float], units: Callable[[StepSample], int]
) -> float:
    """Weighted median of each sample's residual over the decode line per unit (`units`
    counts a sample's; weights: units x recency)."""
    a, b = line
    pairs = []
    for w, s in zip(_weights(len(samples)), samples, strict=True):
        count = units(s)
        pairs.append((max((s.seconds - a - b * s.num_decode) / count, _floor(line)), w * count))
    pairs.sort()
    half = sum(w for _, w in pairs) / 2
    seen = 0.0
    for cost, w in pairs:
        seen += w
        if seen >= half:
            return cost
    return pairs[-1][0]


def _tower_cost(samples: list[StepSample], line: tuple[float, float], token: float) -> float:
    """Recency-weighted sum of the samples' residuals over the decode line less their
    tokens' cost, over their summed token equivalents (floored as _unit_cost's)."""
    a, b = line
    weights = _weights(len(samples))
    seconds = sum(
        w * (s.seconds - a - b * s.num_decode - token * s.num_prefill)
        for w, s in zip(weights, samples, strict=True)
    )
    units = sum(w * s.num_vision for w, s in zip(weights, samples, strict=True))
    return max(seconds / units, _floor(line))


class StepTimer:
    """A step's wall time from when it was planned and when it completed (the scheduler's
    clock). Steps are pipelined (step N is planned before N-1 is read back), so in steady
    state a step's time is the gap between two completions; after an idle gap, or after a
    step in lockstep, it starts when it was planned.

    A step submitted before its predecessor completed was planned and built (its graph,
    `submitted`) inside the gap that ends with that completion: a heavy build (a prompt
    chunk's) would be priced to the step before it, and the step itself would look as
    cheap as the one whose building overlapped it. So such a build counts to its own
    step and not to the gap it ran in: the sum over steps stays the wall time."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}  # step -> when it was planned
        self._submitted: dict[int, tuple[float, float]] = {}  # step -> (when, seconds built)
        self._last_done = float("-inf")  # when the last step completed
        self._last_overlapped = False  # the last step was planned before its predecessor completed

    def planned(self, step: int, at: float) -> None:
        self._started[step] = at

    def submitted(self, step: int, at: float) -> None:
        """The step's forward was queued (its graph built) at `at`."""
        if step in self._started:
            self._submitted[step] = (at, max(0.0, at - self._started[step]))

    def completed(self, step: int, done: float) -> tuple[float, bool]:
        """(seconds, settled). A step in lockstep (nothing planned behind it before it
        completed) is settled; a pipelined one only once it and the step before it were
        both planned while their predecessors ran. The first two pipelined steps after
        a lockstep one are not samples of what such a step costs: the second still runs
        slow, and the first is not an overlapped step's like the rest."""
        started = self._started.pop(step, done)
        at, built = self._submitted.pop(step, (done, 0.0))
        seconds = done - max(started, self._last_done)
        if at <= self._last_done:  # built in the gap before, which did not count it
            seconds += built
        after_at, after_built = self._submitted.get(step + 1, (done, 0.0))
        if after_at <= done:  # the next step was built in this gap: it counts it
            seconds -= after_built
        overlapped = started < self._last_done
        lockstep = self._started.get(step + 1, done) >= done
        settled = lockstep or (overlapped and self._last_overlapped)
        self._last_done, self._last_overlapped = done, overlapped
        return max(seconds, 0.0), settled


class StepHistogram:
    """Step wall times by kind, counted as they complete (engine/api.py StepTimes)."""

    def __init__(self) -> None:
        self._counts = [[0] * (len(STEP_SECONDS_BUCKETS) + 1) for _ in STEP_KINDS]
        self._seconds = [0.0] * len(STEP_KINDS)
        self._host = [0.0] * len(STEP_KINDS)
        self._parts = [[0.0] * len(HOST_PARTS) for _ in STEP_KINDS]
        self._traced = 0

    def observe(self, kind: str, seconds: float, traced: bool) -> None:
        """One step of `kind` (STEP_KINDS) took `seconds`; `traced`: it traced a shape."""
        k = STEP_KINDS.index(kind)
        counts = self._counts[k]
        for i, bound in enumerate(STEP_SECONDS_BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        counts[-1] += 1
        self._seconds[k] += seconds
        self._traced += traced

    def observe_host(self, kind: str, seconds: float, parts: dict[str, float]) -> None:
        """The engine thread spent `seconds` of its own (not waiting on the device) on a
        step of `kind`, `parts` of it in HOST_PARTS' parts."""
        k = STEP_KINDS.index(kind)
        self._host[k] += seconds
        for part, part_seconds in parts.items():
            self._parts[k][HOST_PARTS.index(part)] += part_seconds

    def snapshot(self) -> StepTimes:
        return StepTimes(
            tuple(map(tuple, self._counts)),
            tuple(self._seconds),
            self._traced,
            tuple(self._host),
            tuple(map(tuple, self._parts)),
        )
