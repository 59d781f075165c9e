"""The acceptance rule of speculative decoding: which drafts a row keeps, and its next token.

A row fed its last token and k drafts d_1..d_k in one verify forward; the target's
distributions p_0..p_k come back for the k + 1 positions (p_i scores the token after
d_i, p_0 the token after the last one). Draft i is accepted while every earlier one was
and, with u_i ~ U(0, 1), u_i * q_i(d_i) < p_i(d_i) (probability min(1, p/q)). At the first
rejection, position a, the next token is drawn from max(p_a - q_a, 0) renormalised; when
all k are accepted, from p_k (the bonus token). Then every emitted token is distributed
exactly as the target's own (Leviathan et al. 2023, Chen et al. 2023), whatever q is.

Greedy rows take the argmax instead: drafts are accepted while they equal the target's
argmax, and the next token is the argmax at the first mismatch, so greedy output with
speculation equals greedy output without, token for token. (The stochastic rule with
one-hot p and q is the same thing: `accept_sampled` reproduces `accept_greedy` then.)

Both are pure functions of arrays: the randomness comes in as arguments (`uniform`,
`gumbel`), so the engine can feed the counter-based, per-row-seeded noise of
engine/sampling/noise.py, and tests can feed anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Verdict:
    """Per row: how many drafts it keeps and the token that follows them."""

    num_accepted: mx.array  # [B] int32 in 0..k: the row keeps its last token + these drafts
    next_token: mx.array  # [B] int32: the correction (a < k) or bonus (a == k) token


def _accepted_count(accept: mx.array) -> mx.array:
    """[B, k] bool -> [B] int32: the length of each row's leading run of True."""
    return mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


def accept_greedy(target_logits: mx.array, draft_tokens: mx.array) -> Verdict:
    """target_logits [B, k + 1, V], draft_tokens [B, k] -> Verdict by argmax matching."""
    k = draft_tokens.shape[1]
    assert target_logits.shape[1] == k + 1, "one more target position than drafts"
    best = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # [B, k + 1]
    count = _accepted_count(best[:, :k] == draft_tokens)
    return Verdict(count, mx.take_along_axis(best, count[:, None], axis=1)[:, 0])


def accept_sampled(
    target_probs: mx.array,
    draft_tokens: mx.array,
    draft_probs: mx.array,
    uniform: mx.array,
    gumbel: mx.array,
) -> Verdict:
    """The stochastic rule (module docstring).

    target_probs [B, k + 1, V] and draft_probs [B, k, V]: each a distribution over the
    vocabulary (after the row's temperature / top-k / top-p: the distributions the row
    samples from); draft_tokens [B, k] drawn from draft_probs; uniform [B, k] in [0, 1);
    gumbel [B, V] standard Gumbel noise for the one resample per row.
    """
    k = draft_tokens.shape[1]
    assert target_probs.shape[1] == k + 1 and draft_probs.shape[1] == k, "shapes of k drafts"
    index = draft_tokens[..., None]
    p_draft = mx.take_along_axis(target_probs[:, :k], index, axis=-1)[..., 0]  # [B, k]
    q_draft = mx.take_along_axis(draft_probs, index, axis=-1)[..., 0]
    count = _accepted_count(uniform * q_draft < p_draft)
    # Where to draw from: the residual at each draft position, the target after the last.
    residual = mx.maximum(target_probs[:, :k] - draft_probs, 0.0)
    source = mx.concatenate([residual, target_probs[:, k:]], axis=1)  # [B, k + 1, V]
    row = mx.take_along_axis(source, count[:, None, None], axis=1)[:, 0]  # [B, V]
    # A residual with no mass only follows p == q on the support, where the draft is
    # always accepted; fall back to the target there anyway rather than divide by 0.
    target = mx.take_along_axis(target_probs, count[:, None, None], axis=1)[:, 0]
    row = mx.where(row.sum(axis=-1, keepdims=True) > 0, row, target)
    scores = mx.where(row > 0, mx.log(mx.maximum(row, 1e-38)) + gumbel, -mx.inf)
    return Verdict(count, mx.argmax(scores, axis=-1).astype(mx.int32))


def random_inputs(
    rows: int, num_draft: int, vocab: int, key: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """(uniform [rows, num_draft], gumbel [rows, vocab]) from MLX's RNG (tests, or rows
    without a seed)."""
    k1, k2 = mx.random.split(key) if key is not None else (None, None)
    uniform = mx.random.uniform(shape=(rows, num_draft), key=k1)
    return uniform, mx.random.gumbel(shape=(rows, vocab), key=k2)
