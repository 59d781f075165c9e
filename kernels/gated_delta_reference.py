"""The gated-DeltaNet recurrence token by token, in plain MLX (shapes: kernels/gated_delta.py).

`gated_delta_reference` is the per-step loop the tests compare every fast path against
(and gated_delta_scan's form off CUDA); `gated_delta_step` is one token with one matmul
and a fused rank-1 update: the CPU decode path, and gated_delta_step_fused's form there.
They sit apart from the dispatcher (`gated_delta`) because the kernels it dispatches to
build on them: the imports go kernels -> this module, never back.
"""

from __future__ import annotations

import mlx.core as mx

F32 = mx.float32


def _expand_heads(x: mx.array, hv: int) -> mx.array:
    """[B, L, Hk, D] -> [B, L, Hv, D], value head h taking key head h // (Hv // Hk)."""
    hk = x.shape[2]
    return x if hk == hv else mx.repeat(x, hv // hk, axis=2)


def _as_f32(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    expand: bool = True,
) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]:
    """Casts everything to float32, fills a missing state, and (if expand) repeats q/k
    to Hv heads; otherwise only checks that Hv is a multiple of Hk."""
    b, _, hv, dv = v.shape
    hk, dk = k.shape[2], k.shape[-1]
    if hv % hk:
        raise ValueError(f"Hv={hv} is not a multiple of Hk={hk}")
    if state is None:
        state = mx.zeros((b, hv, dv, dk), F32)
    q, k = q.astype(F32), k.astype(F32)
    if expand:
        q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    return q, k, v.astype(F32), g.astype(F32), beta.astype(F32), state.astype(F32)


def gated_delta_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
    every_state: bool = False,
) -> tuple[mx.array, mx.array]:
    """Plain per-step loop in float32 (test oracle only: O(L) small ops, slow).
    every_state: return the state after each token, [B, L, Hv, Dv, Dk], not the last."""
    out_dtype = v.dtype
    q, k, v, g, beta, s = _as_f32(q, k, v, g, beta, state)
    ys, states = [], []
    for t in range(v.shape[1]):
        s_new = s * mx.exp(g[:, t])[..., None, None]
        kv_mem = (s_new * k[:, t, :, None, :]).sum(-1)  # [B, Hv, Dv]
        delta = beta[:, t, :, None] * (v[:, t] - kv_mem)  # [B, Hv, Dv]
        s_new = s_new + delta[..., None] * k[:, t, :, None, :]  # outer -> [B, Hv, Dv, Dk]
        y = (s_new * q[:, t, :, None, :]).sum(-1)  # [B, Hv, Dv]
        if mask is not None:
            m = mask[:, t, None].astype(mx.bool_)  # [B, 1]
            s_new = mx.where(m[..., None, None], s_new, s)
            y = mx.where(m[..., None], y, 0.0)
        s = s_new
        ys.append(y)
        states.append(s)
    return mx.stack(ys, axis=1).astype(out_dtype), mx.stack(states, axis=1) if every_state else s


def _step_core(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, s: mx.array
) -> tuple[mx.array, mx.array]:
    """One token, all heads: q, k [B, Hv, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; s [B,Hv,Dv,Dk].

    Uses y = a*(S q) + delta*(k.q) with a = exp(g), so S is read by ONE matmul against
    [k | q] ([B, Hv, Dk, 2]) and written once by the rank-1 update.
    """
    a = mx.exp(g)[..., None]  # [B, Hv, 1]
    sk_sq = s @ mx.stack([k, q], axis=-1)  # [B, Hv, Dv, 2]
    delta = beta[..., None] * (v - a * sk_sq[..., 0])  # [B, Hv, Dv]
    kq = (k * q).sum(-1, keepdims=True)  # [B, Hv, 1]
    y = a * sk_sq[..., 1] + delta * kq  # [B, Hv, Dv]
    s_new = a[..., None] * s + delta[..., None] * k[:, :, None, :]  # [B, Hv, Dv, Dk]
    return y, s_new


def _step_masked(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, s: mx.array, m: mx.array
) -> tuple[mx.array, mx.array]:
    """`_step_core` where m [B] False keeps s bit-identical and gives y = 0."""
    y, s_new = _step_core(q, k, v, g, beta, s)
    return mx.where(m[:, None, None], y, 0.0), mx.where(m[:, None, None, None], s_new, s)


# Compiled so the elementwise tail fuses; S ([B, Hv, Dv, Dk] f32) is the only large tensor.
_step_plain = mx.compile(_step_core)
_step_plain_masked = mx.compile(_step_masked)


def gated_delta_step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Single-token (L == 1) decode path: one matmul plus a fused rank-1 state update."""
    if v.shape[1] != 1:
        raise ValueError(f"gated_delta_step needs L == 1, got L = {v.shape[1]}")
    out_dtype = v.dtype
    q, k, v, g, beta, s = _as_f32(q, k, v, g, beta, state)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s)
    if mask is None:
        y, s = _step_plain(*args)
    else:
        y, s = _step_plain_masked(*args, mask[:, 0].astype(mx.bool_))
    return y[:, None].astype(out_dtype), s
