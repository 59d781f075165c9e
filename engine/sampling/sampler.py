"""Vectorized next-token sampler: one pass over a batch whose rows have different params.

Per row, in this order (each stage is built only when some row in the batch needs it):
allowed tokens (constrained rows: a packed bitmask, -inf elsewhere) -> logit_bias (+) ->
repetition penalty (HF: prompt + output tokens) -> presence/frequency
(OpenAI: generated tokens) -> temperature -> top_k -> top_p -> min_p -> Gumbel-max draw.
The last four are engine/sampling/warp.py's, which speculative sampling shares.
Greedy rows (temperature 0 or top_k 1) take the argmax of their processed logits.

Logprobs are log_softmax of the *processed* logits at temperature 1: after bias and
penalties (what the request asked the model to be), before temperature and truncation
(which only shape how we draw). A greedy row's token is the argmax of that distribution.

Forced tokens (a thinking budget's close, SamplingParams.forced_token): a row
that must write a given token draws as usual, then its token is replaced by the forced one
(one [N] select, built only in a step where some row is forced). A mask allowing only that
token would do the same through the constraint path, but it costs a whole-vocabulary mask
in a step that needs one id, and its logprob would be 0 by construction. Replacing after
the draw leaves every other row's draw and noise untouched (seeded draws are keyed by
(seed, choice, step)), and the forced token's logprob is what the model gave it.

Randomness: Gumbel-max, argmax(y + g) with g = -log(-log(u)) and u a counter-based hash
of (row key, vocab id). A seeded row's key is a function of (seed, choice, step) only, so
its draws do not depend on batch size, row position or neighbours. Unseeded rows get
their key from MLX's global RNG (mx.random), so they follow mx.random.seed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from deltaserve.engine.sampling.noise import gumbel_noise, row_key
from deltaserve.engine.sampling.warp import Warp, keep_threshold, nucleus_size
from deltaserve.engine.structured.token_mask import apply_token_mask
from deltaserve.engine.types import SamplingParams, TokenLogprob
from deltaserve.kernels.argmax import argmax_rows

_CACHE_SIZE = {"plans": 8, "prompts": 512}
# Row groups, each drawn one way; a batch's tokens come out group by group.
_KINDS = _GREEDY, _TOP_K, _TOP_P, _PLAIN = "greedy", "top_k", "top_p", "plain"


@dataclass(frozen=True)
class SamplingRow:
    """One row that samples this step. Built by the engine.

    `choice` (completion index of an n > 1 request) goes into the seeded key so that forks
    of one seeded request draw different, still reproducible, tokens."""

    params: SamplingParams
    prompt_ids: Sequence[int]  # repetition penalty covers prompt + output (HF)
    output_ids: Sequence[int]  # generated so far; len() is the step that seeds the draw
    choice: int = 0
    forced_token: int | None = None  # written instead of the draw (see the module docstring)


def _masked_scores(y: mx.array, t: mx.array, k0: mx.array, k1: mx.array, ids: mx.array) -> mx.array:
    return mx.where(y >= t, y + gumbel_noise(k0, k1, ids), -mx.inf)  # keep y >= threshold t


# One fused elementwise kernel (hash, logs, mask); shapeless so a new batch size reuses it.
_masked_scores_fused = mx.compile(_masked_scores, shapeless=True)


def _rows_index(rows: list[int], n: int) -> mx.array | None:
    """Gather index for `rows` of an n-row array; None when it is all rows in order."""
    return None if rows == list(range(n)) else mx.array(rows, dtype=mx.int32)


def _spread_index(rows: list[int], n: int) -> mx.array:
    """Index that spreads len(rows) values (+1 filler at the end) back to n rows."""
    where = {r: j for j, r in enumerate(rows)}
    return mx.array([where.get(i, len(rows)) for i in range(n)], dtype=mx.int32)


def _take(x: mx.array, index: mx.array | None) -> mx.array:
    return x if index is None else x[index]


def _ids(seq: Sequence[int]) -> np.ndarray:
    return np.asarray(seq, dtype=np.int64).reshape(-1)


def _kind(p: SamplingParams, vocab: int) -> str:
    if p.is_greedy:
        return _GREEDY
    if 0 < p.top_k < vocab:
        return _TOP_K
    return _TOP_P if p.top_p < 1.0 else _PLAIN


class _Group:
    """Rows of a batch drawn the same way, with their per-row parameter arrays."""

    def __init__(
        self, kind: str, rows: list[int], params: tuple[SamplingParams, ...], vocab: int
    ) -> None:
        ps = [params[i] for i in rows]
        self.kind, self.rows = kind, rows
        self.index = _rows_index(rows, len(params))  # gather index into the batch
        self.warp = Warp.of(ps, vocab)


def _build_bias(params: tuple[SamplingParams, ...], vocab: int) -> tuple[mx.array, mx.array]:
    # Token ids outside the vocabulary cannot be produced, so their bias is dropped.
    idx = [r * vocab + t for r, p in enumerate(params) for t in p.logit_bias if t < vocab]
    val = [b for p in params for t, b in p.logit_bias.items() if t < vocab]
    return mx.array(idx, dtype=mx.int64), mx.array(val, dtype=mx.float32)


class _Plan:
    """Everything about a batch that depends only on its params and order (cached)."""

    def __init__(self, params: tuple[SamplingParams, ...], vocab: int) -> None:
        n = len(params)
        self.params = params
        kinds = [_kind(p, vocab) for p in params]
        rows = {k: [i for i in range(n) if kinds[i] == k] for k in _KINDS}
        self.groups = [_Group(k, r, params, vocab) for k, r in rows.items() if r]
        order = [i for g in self.groups for i in g.rows]
        # Tokens come out group by group; `order` puts them back in row order.
        self.order = _spread_index(order, n) if order != list(range(n)) else None
        self.bias = _build_bias(params, vocab) if any(p.logit_bias for p in params) else None
        self.rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        pen_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        self.pen_rows = pen_rows
        self.processed = self.bias is not None or bool(self.rep_rows or self.pen_rows)
        self.lp_rows = [i for i, p in enumerate(params) if p.logprobs]
        self.lp_index = _rows_index(self.lp_rows, n) if self.lp_rows else None
        self.lp_spread = None if self.lp_index is None else _spread_index(self.lp_rows, n)
        self.top_max = max((params[i].top_logprobs for i in self.lp_rows), default=0)
        self.fast_greedy = len(rows[_GREEDY]) == n and not (self.processed or self.lp_rows)


@dataclass
class SampledBatch:
    """Sampled tokens (and logprobs) of one step as lazy mx arrays.

    Nothing synchronises until to_python(); pass arrays() to mx.async_eval to overlap the
    sampler with host work. Rows that did not ask for logprobs hold filler values.
    """

    tokens: mx.array  # [N] int32
    logprobs: mx.array | None = None  # [N] float32
    top_ids: mx.array | None = None  # [N, K] int32, K = max top_logprobs, best first
    top_logprobs: mx.array | None = None  # [N, K] float32

    def arrays(self) -> list[mx.array]:
        """The arrays to evaluate (for mx.eval / mx.async_eval)."""
        out = [self.tokens, self.logprobs, self.top_ids, self.top_logprobs]
        return [a for a in out if a is not None]

    def to_python(self, rows: Sequence[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Token ids, and a TokenLogprob for each row whose params ask for logprobs."""
        tokens = self.tokens.tolist()
        out: list[TokenLogprob | None] = [None] * len(tokens)
        if self.logprobs is None:
            return tokens, out
        lps = self.logprobs.tolist()
        none: list[list] = [[]] * len(tokens)
        ids = self.top_ids.tolist() if self.top_ids is not None else none
        vals = self.top_logprobs.tolist() if self.top_logprobs is not None else none
        for i, row in enumerate(rows):
            if row.params.logprobs:  # top_logprobs trims the batch-wide top K
                k = row.params.top_logprobs
                top = tuple(zip(ids[i][:k], vals[i][:k], strict=True))
                out[i] = TokenLogprob(tokens[i], lps[i], top)
        return tokens, out


class Sampler:
    """Samples one token per row from [N, V] logits, rows with mixed SamplingParams.

    Not thread-safe: one engine thread owns it. It caches the per-batch parameter arrays
    (keyed by the identity of each row's SamplingParams) and each prompt's unique ids.
    """

    def __init__(self, lazy_tokens: bool = True) -> None:
        """lazy_tokens=False: the caller reads the tokens back right away (an engine whose
        steps run in lockstep), so the final argmax may evaluate the scores and reduce them
        on the host where that is faster (kernels/argmax.py)."""
        self.lazy_tokens = lazy_tokens
        self._plans: OrderedDict[tuple[int, ...], _Plan] = OrderedDict()
        self._prompts: OrderedDict[tuple[int, int], tuple] = OrderedDict()  # (prompt, unique ids)

    def sample(
        self, logits: mx.array, rows: Sequence[SamplingRow], allowed: np.ndarray | None = None
    ) -> SampledBatch:
        """Draw one token per row; logits [N, V] (any float dtype), one row per SamplingRow;
        `allowed`: the tokens each row may draw, packed (engine/structured/token_mask.py)."""
        if not rows:  # argmax cannot reduce an empty batch
            return SampledBatch(mx.zeros((0,), dtype=mx.int32))
        plan = self._plan(rows, logits.shape[1])
        if allowed is not None:
            logits = apply_token_mask(logits, allowed)
        if plan.fast_greedy:
            return SampledBatch(_forced(argmax_rows(logits, self.lazy_tokens), rows))
        z = self._process(logits.astype(mx.float32), rows, plan)
        parts = [self._draw(_take(z, g.index), rows, g) for g in plan.groups]
        tokens = mx.concatenate(parts).astype(mx.int32)
        tokens = _forced(tokens if plan.order is None else tokens[plan.order], rows)
        return SampledBatch(tokens, *(_logprobs(z, tokens, plan) if plan.lp_rows else ()))

    def process(self, logits: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
        """The logits after logit_bias and penalties, [N, V] float32 (lazy)."""
        plan = self._plan(rows, logits.shape[1])
        return self._process(logits.astype(mx.float32), rows, plan)

    def _plan(self, rows: Sequence[SamplingRow], vocab: int) -> _Plan:
        # Holding the params in the cached plan keeps their ids from being reused.
        key = (vocab, *(id(r.params) for r in rows))
        plan = self._plans.get(key)
        if plan is None or any(a is not r.params for a, r in zip(plan.params, rows, strict=True)):
            plan = _Plan(tuple(r.params for r in rows), vocab)
        _remember(self._plans, key, plan, _CACHE_SIZE["plans"])
        return plan

    def _process(self, z: mx.array, rows: Sequence[SamplingRow], plan: _Plan) -> mx.array:
        if not plan.processed:
            return z
        n, vocab = z.shape
        flat = z.reshape(-1)  # flat [N*V] index = row * V + token: one scatter for all rows
        if plan.bias is not None:
            flat = flat.at[plan.bias[0]].add(plan.bias[1])
        if plan.rep_rows:
            flat = self._repetition(flat, rows, plan.rep_rows, vocab)
        if plan.pen_rows:
            flat = _presence_frequency(flat, rows, plan.pen_rows, vocab)
        return flat.reshape(n, vocab)

    def _prompt_unique(self, prompt: Sequence[int]) -> np.ndarray:
        # Fixed for the request's lifetime: dedupe once (a prompt list that grows re-keys).
        key = (id(prompt), len(prompt))
        hit = self._prompts.get(key)
        ids = hit[1] if hit is not None and hit[0] is prompt else np.unique(_ids(prompt))
        _remember(self._prompts, key, (prompt, ids), _CACHE_SIZE["prompts"])
        return ids

    def _repetition(
        self, flat: mx.array, rows: Sequence[SamplingRow], rep_rows: list[int], vocab: int
    ) -> mx.array:
        idx, pen = [], []
        for r in rep_rows:
            prompt = self._prompt_unique(rows[r].prompt_ids)
            ids = np.concatenate([prompt, _ids(rows[r].output_ids)])
            idx.append(ids + r * vocab)
            pen.append(np.full(len(ids), rows[r].params.repetition_penalty, np.float32))
        index = mx.array(np.concatenate(idx))
        penalty = mx.array(np.concatenate(pen))
        # Duplicate ids (a token in prompt and output) all write the same value: scatter
        # "set" is then order-independent, so no per-step dedupe of prompt + output.
        g = flat[index]
        flat[index] = mx.where(g > 0, g / penalty, g * penalty)
        return flat

    def _draw(self, z: mx.array, rows: Sequence[SamplingRow], g: _Group) -> mx.array:
        """Token ids [G] of group g from its processed logits z [G, V]."""
        if g.kind == _GREEDY:
            return argmax_rows(z, self.lazy_tokens)
        y = z * g.warp.inv_temp
        k0, k1 = noise_keys([rows[i] for i in g.rows])
        if g.kind == _TOP_K:
            return _draw_top_k(y, g.warp, k0, k1)
        # The nucleus needs the whole row sorted: a bounded prefix cannot be proved to
        # hold it without a host sync.
        descending = mx.sort(y, axis=-1)[:, ::-1] if g.kind == _TOP_P else None
        thr = keep_threshold(y, g.warp, descending)
        ids = mx.arange(y.shape[1], dtype=mx.uint32)[None]
        return argmax_rows(_masked_scores_fused(y, thr, k0, k1, ids), self.lazy_tokens)


def _forced(tokens: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
    """tokens [N] with each forced row's token in place of its draw."""
    forced = [r.forced_token for r in rows]
    if all(t is None for t in forced):
        return tokens
    is_forced = mx.array([t is not None for t in forced])
    ids = mx.array([t if t is not None else 0 for t in forced], dtype=tokens.dtype)
    return mx.where(is_forced, ids, tokens)


def _draw_top_k(y: mx.array, warp: Warp, k0: mx.array, k1: mx.array) -> mx.array:
    # Partition out the group's largest k, sort only those, and draw among them with the
    # same per-(key, vocab id) noise the full row would get: identical draws, at O(V)
    # cost instead of a sort plus noise over the whole vocabulary.
    ids, vals = top_sorted(y, warp.kmax)
    # Keep by position: top_k keeps exactly k tokens (ties at the k-th broken arbitrarily).
    keep = mx.arange(warp.kmax)[None] < nucleus_size(vals, warp.top_k, warp.top_p)
    if warp.log_min_p is not None:
        keep = keep & (vals >= vals[:, :1] + warp.log_min_p)
    scores = mx.where(keep, vals + gumbel_noise(k0, k1, ids.astype(mx.uint32)), -mx.inf)
    return mx.take_along_axis(ids, mx.argmax(scores, axis=-1, keepdims=True), axis=-1)[:, 0]


def top_sorted(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Ids and values of the k largest entries of each row of x [G, V], best first."""
    kth = max(x.shape[1] - k, 0)  # O(V) partition, then sort only the k survivors
    ids = mx.argpartition(x, kth=kth, axis=-1)[:, kth:]
    vals = mx.take_along_axis(x, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def noise_keys(
    rows: Sequence[SamplingRow], stream: int = 0, ahead: int = 0
) -> tuple[mx.array, mx.array]:
    """Per row 64-bit noise key of its output index len(output_ids) + ahead in `stream`
    (engine/sampling/noise.py) as two [G, 1] uint32 halves: seeded rows' from their
    seed, the others' from MLX's global RNG (fresh on every call). `ahead`: a speculative
    verify's later positions, drawn with the keys the plain sampler would use there."""
    seeded = [r.params.seed is not None for r in rows]
    if not any(seeded):
        keys = _random_keys(len(rows))
    else:
        # Unseeded rows get a placeholder key here, replaced by a random one below.
        seeds = [
            row_key(r.params.seed or 0, r.choice, len(r.output_ids) + ahead, stream) for r in rows
        ]
        host = np.array(seeds, dtype=np.uint64)
        keys = mx.array(host.view(np.uint32).reshape(len(rows), 2))
        if not all(seeded):
            keys = mx.where(mx.array(seeded)[:, None], keys, _random_keys(len(rows)))
    return keys[:, :1], keys[:, 1:]


def _random_keys(n: int) -> mx.array:
    # mx.random.randint draws through float32, so only ~24 bits per value are random:
    # build each 32-bit half from two exact 16-bit draws.
    r = mx.random.randint(0, 1 << 16, (n, 4), dtype=mx.uint32)
    return mx.stack([r[:, 0] | (r[:, 1] << 16), r[:, 2] | (r[:, 3] << 16)], axis=1)


def _logprobs(z: mx.array, tokens: mx.array, plan: _Plan) -> list[mx.array | None]:
    """[token logprob, top ids, top logprobs], spread to all N rows."""
    zl = _take(z, plan.lp_index)
    lse = mx.logsumexp(zl, axis=-1, keepdims=True)
    token_z = mx.take_along_axis(zl, _take(tokens, plan.lp_index)[:, None], axis=-1)
    out: list[mx.array | None] = [(token_z - lse)[:, 0], None, None]
    if plan.top_max:
        ids, vals = top_sorted(zl, plan.top_max)
        out[1], out[2] = ids.astype(mx.int32), vals - lse
    if plan.lp_spread is None:
        return out
    return [_spread(a, plan.lp_spread) if a is not None else None for a in out]


def _spread(a: mx.array, spread: mx.array) -> mx.array:
    filler = mx.zeros((1, *a.shape[1:]), dtype=a.dtype)
    return mx.concatenate([a, filler])[spread]


def _remember(cache: OrderedDict, key: object, value: object, size: int) -> None:
    cache[key] = value  # (re)insert as most recent; drop the least recent past `size`
    cache.move_to_end(key)
    if len(cache) > size:
        cache.popitem(last=False)


def _presence_frequency(
    flat: mx.array, rows: Sequence[SamplingRow], pen_rows: list[int], vocab: int
) -> mx.array:
    idx, delta = [], []
    for r in pen_rows:
        toks, counts = np.unique(_ids(rows[r].output_ids), return_counts=True)
        p = rows[r].params
        idx.append(toks + r * vocab)
        delta.append(-(p.presence_penalty + p.frequency_penalty * counts))
    index = np.concatenate(idx)
    if not len(index):
        return flat
    return flat.at[mx.array(index)].add(mx.array(np.concatenate(delta), dtype=mx.float32))
