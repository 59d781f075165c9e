"""What a step costs on this model and machine, learned from measured step times.

Pure Python (no mx.array): the scheduler asks it how many prefill tokens fit next to the
decode rows without stalling them by more than a set factor.

The model: a step with D decode rows and P prefill tokens takes

    t(D, P) ~= a + b * D + c * P

fitted online from the engine's own steps, two kinds of sample kept apart:

- decode-only steps (P = 0) give `a + b * D`: a least-squares line through the last
  WINDOW samples, recent ones weighing more (each older sample by DECAY), after dropping
  outliers above OUTLIER x the median (a GC pause, a first-use compile). With no spread
  in D it is the weighted mean (b = 0); b is never negative.
- steps with decode rows and prefill give `c`: each one's residual over the decode line,
  per prefill token; c is the weighted median of those (weights: tokens x recency), so
  one slow step does not shrink the allowance for long. The residual absorbs per-group
  overheads and the attention cost of long contexts at the sizes the scheduler actually
  runs, and moves with them as a prompt's context grows.

Prefill samples are kept raw and refitted against the current decode line. Prefill-only
steps are not used: with no decode row the line's intercept is an extrapolation (with
one decode batch size seen, it is that size's time), and they need no bound. Until there
are MIN_SAMPLES decode-only steps, `prefill_allowance` returns None: no constraint, as
without the model. With decode samples but no prefill sample yet it returns 0 (the
scheduler then runs its minimum): the first prefill next to decode rows is a small probe,
and the allowance grows from what it measured, at most GROWTH x the largest prefill in
the window per step (a probe's residual is mostly noise).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 32  # samples kept of each kind
DECAY = 0.9  # weight of a sample relative to the next newer one
MIN_SAMPLES = 3  # decode-only steps before the model constrains anything
OUTLIER = 3.0  # decode-only samples above this x the median are ignored
GROWTH = 2  # the allowance is at most this x the largest prefill sample in the window


@dataclass(frozen=True)
class StepSample:
    num_decode: int  # decode rows of the step
    num_prefill: int  # prefill tokens of the step
    seconds: float  # measured wall time of the step


class StepCostModel:
    """Online fit of step time = a + b * decode_rows + c * prefill_tokens."""

    def __init__(self) -> None:
        self._decode: deque[StepSample] = deque(maxlen=WINDOW)
        self._prefill: deque[StepSample] = deque(maxlen=WINDOW)
        self._line: tuple[float, float] | None = None  # (a, b), refitted lazily
        self._token_cost: float | None = None

    def observe(self, num_decode: int, num_prefill: int, seconds: float) -> None:
        """Record one completed step (ignored if it took no time or decoded nothing)."""
        if seconds <= 0 or num_decode == 0:
            return
        sample = StepSample(num_decode, num_prefill, seconds)
        (self._prefill if num_prefill else self._decode).append(sample)
        self._line = self._token_cost = None

    @property
    def is_ready(self) -> bool:
        """Enough decode-only samples to predict a decode step."""
        return len(self._decode) >= MIN_SAMPLES

    def decode_seconds(self, num_decode: int) -> float:
        """Predicted time of a decode-only step of `num_decode` rows (needs samples)."""
        a, b = self._decode_line()
        return a + b * num_decode

    def token_seconds(self) -> float:
        """Predicted marginal time of one prefill token (needs samples of both kinds)."""
        if self._token_cost is None:
            self._token_cost = _token_cost(list(self._prefill), self._decode_line())
        return self._token_cost

    def predict(self, num_decode: int, num_prefill: int) -> float:
        return self.decode_seconds(num_decode) + self.token_seconds() * num_prefill

    def prefill_allowance(self, num_decode: int, max_stall_factor: float) -> int | None:
        """Prefill tokens that keep a step with `num_decode` rows within `max_stall_factor`
        x a decode-only step; None while the model has too few samples to say."""
        if not self.is_ready:
            return None
        if not self._prefill:
            return 0
        extra = (max_stall_factor - 1.0) * self.decode_seconds(num_decode)
        fit = int(extra / self.token_seconds() + 1e-6)  # not 139 for 139.99999
        # Slow start: at most GROWTH x the largest prefill seen next to decode rows. A
        # small probe's residual is mostly noise (a 3-token chunk can look free), and
        # the fit alone would then hand the next step the whole token budget.
        return min(fit, GROWTH * max(s.num_prefill for s in self._prefill))

    def _decode_line(self) -> tuple[float, float]:
        if self._line is None:
            self._line = _fit_line(list(self._decode))
        return self._line


def _weights(n: int) -> list[float]:
    """Recency weights of n samples, oldest first."""
    return [DECAY ** (n - 1 - i) for i in range(n)]


def _fit_line(samples: list[StepSample]) -> tuple[float, float]:
    """Weighted least squares of seconds on decode rows, outliers dropped; b >= 0."""
    median = sorted(s.seconds for s in samples)[len(samples) // 2]
    kept = [
        (w, s)
        for w, s in zip(_weights(len(samples)), samples, strict=True)
        if s.seconds <= OUTLIER * median
    ]
    total = sum(w for w, _ in kept)
    mean_x = sum(w * s.num_decode for w, s in kept) / total
    mean_y = sum(w * s.seconds for w, s in kept) / total
    var_x = sum(w * (s.num_decode - mean_x) ** 2 for w, s in kept) / total
    cov = sum(w * (s.num_decode - mean_x) * (s.seconds - mean_y) for w, s in kept) / total
    if var_x < 0.25 or cov <= 0:  # rows barely varied, or noise says "more rows, faster"
        return mean_y, 0.0
    b = cov / var_x
    a = mean_y - b * mean_x
    if a < 0:  # the line would go below zero at few rows: proportional instead
        return 0.0, mean_y / mean_x
    return a, b


def _token_cost(samples: list[StepSample], line: tuple[float, float]) -> float:
    """Weighted median of each sample's per-token residual over the decode line."""
    a, b = line
    floor = 1e-3 * (a + b) + 1e-9  # a token is never free: keeps the allowance finite
    pairs = sorted(
        (max((s.seconds - a - b * s.num_decode) / s.num_prefill, floor), w * s.num_prefill)
        for w, s in zip(_weights(len(samples)), samples, strict=True)
    )
    half = sum(w for _, w in pairs) / 2
    seen = 0.0
    for cost, w in pairs:
        seen += w
        if seen >= half:
            return cost
    return pairs[-1][0]
