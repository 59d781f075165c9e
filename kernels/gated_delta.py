"""Gated-DeltaNet recurrence (Qwen3.5 linear-attention layers) behind one function.

Shapes (MLX convention, state kept as [Dv, Dk] per value head, always float32):
    q, k  [B, L, Hk, Dk]   already L2-normalised; q already scaled by Dk**-0.5
    v     [B, L, Hv, Dv]
    g     [B, L, Hv]       log-decay (<= 0)
    beta  [B, L, Hv]       in (0, 1)
    state [B, Hv, Dv, Dk]
    mask  [B, L] bool      True = real token; a False step leaves the state untouched, y = 0

Value head h reads q/k head h // (Hv // Hk) (repeat-interleave). Per step and value head:
    S <- exp(g) S ; delta = beta (v - S k) ; S <- S + delta k^T ; y = S q

`gated_delta` dispatches: on CUDA with `scan`, L > 1 -> `gated_delta_scan` (one kernel that
holds each state row in registers across the tokens); L == 1 -> `gated_delta_step_fused`
(decode: one CUDA/Metal kernel that reads and writes the state once; `gated_delta_step` on
CPU); Metal without mask ->
`mx.fast.gated_delta_update` (Apple's kernels); otherwise `gated_delta_chunked` (WY/UT
form, float32 matmuls; the prefill path on CPU and CUDA). `gated_delta_reference` is the
plain per-step loop the tests compare against; nothing dispatches to it. It and
`gated_delta_step` live in kernels/gated_delta_reference.py (the fused and scan kernels
build on them) and are re-exported here.
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.kernels.gated_delta_fused import gated_delta_step_fused
from deltaserve.kernels.gated_delta_reference import (
    _as_f32,
    gated_delta_reference,
    gated_delta_step,
)
from deltaserve.kernels.gated_delta_scan import gated_delta_scan, scan_supported
from deltaserve.kernels.platform import current_platform

__all__ = [
    "gated_delta",
    "gated_delta_chunked",
    "gated_delta_reference",
    "gated_delta_step",
]

F32 = mx.float32

# Decay products inside a chunk span e^(sum g) (g can be -5 per step: e^-320 over 64 steps).
# x86 GEMMs with denormal operands run 10-100x slower (measured: 1.0 s instead of 0.07 s
# for one L=512 prefill), so decays and inverse blocks below 2^-40 are flushed to 0. Then a
# product of up to three flushed factors stays >= 2^-120, a normal float32. Dropped terms
# are < 1e-12 against the O(1) terms they are summed with: far below float32 resolution.
_TINY = 2.0**-40


def _flush(x: mx.array) -> mx.array:
    """Zeroes entries with |x| < _TINY (keeps denormals out of the GEMMs)."""
    return mx.where(mx.abs(x) < _TINY, 0.0, x)


def _small_bmm(x: mx.array, y: mx.array) -> mx.array:
    """x @ y for tiny blocks (<= 4 wide) as broadcast-multiply-sum: one op, no per-matrix GEMM."""
    return (x[..., :, :, None] * y[..., None, :, :]).sum(-2)


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], C a power of two.

    On the CPU one LAPACK call (mx.linalg.tri_inv, trtri: CPU-only in MLX): the block
    recursion below is ~10 ops a level and cost 1.55 ms against 0.39 ms for [1, 8, 2,
    64, 64] (small shape, 128 tokens, one layer), and a prompt chunk runs it per layer.
    Elsewhere, and as the CPU path's reference, `_unit_lower_inverse_blocks`."""
    if _lapack_inverse():
        return mx.linalg.tri_inv(a + mx.eye(a.shape[-1], dtype=a.dtype), upper=False)
    return _unit_lower_inverse_blocks(a)


def _lapack_inverse() -> bool:
    """Whether `_unit_lower_inverse` runs LAPACK (the CPU), which takes any C; the block
    recursion elsewhere needs C a power of two."""
    return current_platform().is_cpu


def _unit_lower_inverse_blocks(a: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], C a power of two.

    Recursive 2x2 block inversion, all blocks of one size at once (log2 C levels):
        [[X11, 0], [X21, X22]] with X21 = -X22 A21 X11.
    This is LAPACK trtri's scheme: as stable as forward substitution. The Neumann product
    prod (I + (-A)^(2^i)) is NOT: with correlated keys (A ~ lower ones, beta ~ 1) the
    powers reach C(63, 31) ~ 1e18 and cancel catastrophically in float32 (measured error
    1e10). Plain matmuls, so it also runs on GPUs (mx.linalg.solve_triangular is CPU-only).
    """
    c = a.shape[-1]
    lead = a.shape[:-2]
    x = mx.ones((*lead, c, 1, 1), F32)  # diagonal blocks of size 1 of the inverse
    b = 1
    while b < c:
        p = c // (2 * b)  # number of block pairs at this level
        # A21 of pair i is the block at rows (2i+1)b.., cols 2ib..: [..., P, b, b]
        r = a.reshape(*lead, p, 2, b, p, 2, b)[..., :, 1, :, :, 0, :]
        a21 = mx.moveaxis(mx.diagonal(r, axis1=-4, axis2=-2), -1, -3)
        x11, x22 = x[..., 0::2, :, :], x[..., 1::2, :, :]
        mm = _small_bmm if b <= 4 else mx.matmul
        x21 = -_flush(mm(x22, mm(a21, x11)))
        # Assemble [[X11, 0], [X21, X22]] per pair with one copy: [..., P, 2, 2, b, b]
        # (block row, block col, row, col) -> [..., P, 2b, 2b].
        blocks = mx.stack([x11, mx.zeros_like(x11), x21, x22], axis=-3)
        blocks = blocks.reshape(*lead, p, 2, 2, b, b).swapaxes(-3, -2)
        x = blocks.reshape(*lead, p, 2 * b, 2 * b)
        b *= 2
    return x.reshape(*lead, c, c)


def _to_chunks(x: mx.array, pad: int, c: int) -> mx.array:
    """[B, L, H, ...] -> [B, H, N, C, ...], zero-padding L on the right to N * C."""
    if pad:
        x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = mx.moveaxis(x, 2, 1)
    return x.reshape(x.shape[0], x.shape[1], -1, c, *x.shape[3:])


def _chunk_decays(alpha: mx.array) -> tuple[mx.array, mx.array]:
    """Decay products inside each chunk from the per-step linear decays alpha [B,H,N,C].

    Returns decay [B,H,N,C,C] with decay[i,j] = prod_{j<t<=i} alpha_t = e^(G_i - G_j) for
    j <= i (0 above the diagonal) and ecum [B,H,N,C] = e^(G_i) = prod_{t<=i} alpha_t.
    Built with cumprod, not exp(G_i - G_j): on this CPU build mx.exp costs ~22 ns/element
    (C*C of them per chunk dominated the whole prefill), and products are also what the
    per-step recurrence computes. Masked steps have alpha = 1 exactly. Both are flushed
    below _TINY.
    """
    c = alpha.shape[-1]
    # m[i, j] = alpha_i below the diagonal, 1 elsewhere; cumprod over i then telescopes.
    m = mx.where(mx.tri(c, k=-1, dtype=mx.bool_), alpha[..., :, None], 1.0)
    decay = mx.cumprod(m, axis=-2)
    decay = mx.where(mx.tri(c, dtype=mx.bool_) & (decay >= _TINY), decay, 0.0)
    ecum = mx.cumprod(alpha, axis=-1)
    return decay, mx.where(ecum >= _TINY, ecum, 0.0)


def _chunk_terms(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array
) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """Everything that does not depend on the carried state, for all chunks at once.

    In: q, k [B,Hk,N,C,Dk] (key heads); v [B,Hv,N,C,Dv]; g, beta [B,Hv,N,C]. With
    G = cumsum(g) inside the chunk, T = (I + A)^-1, A[i,j] = beta_i (k_i.k_j) e^(G_i - G_j)
    for j < i, and S0 the state entering the chunk (HF's torch_chunk_gated_delta_rule):
        u = T (beta v), w = T (beta k e^G)        -> v_new = u - w S0^T
        y = (q e^G) S0^T + P v_new,    P[i,j] = (q_i.k_j) e^(G_i - G_j) for j <= i
        S1 = e^(G_last) S0 + v_new^T (k e^(G_last - G))
    Returns wq = [w ; q e^G] [B,Hv,N,2C,Dk] (one GEMM against S0^T per chunk), u
    [B,Hv,N,C,Dv], P [B,Hv,N,C,C], kd = k e^(G_last - G) [B,Hv,N,C,Dk], e^(G_last) [B,Hv,N].
    """
    b, hk, _, c, _ = k.shape
    hv, dv = v.shape[1], v.shape[-1]

    def grp(x: mx.array) -> mx.array:  # [B, Hv, ...] -> [B, Hk, Hv/Hk, ...] (free reshape)
        return x.reshape(b, hk, hv // hk, *x.shape[2:])

    def ungrp(x: mx.array) -> mx.array:  # inverse of grp
        return x.reshape(b, hv, *x.shape[3:])

    decay, ecum = _chunk_decays(mx.exp(g))  # [B, Hv, N, C, C], [B, Hv, N, C]
    # Gram blocks once per KEY head (half the GEMMs when Hv = 2 Hk), broadcast to the
    # value heads that share it in the elementwise products: [B, Hk, 1, N, C, C].
    kt = k.swapaxes(-1, -2)
    kk, qk = (k @ kt)[:, :, None], (q @ kt)[:, :, None]
    strict = mx.tri(c, k=-1, dtype=mx.bool_)
    a = ungrp(mx.where(strict, kk * grp(beta[..., :, None] * decay), 0.0))
    p = ungrp(qk * grp(decay))  # causal intra-chunk scores (diagonal kept)
    k_b = ungrp(k[:, :, None] * grp(beta * ecum)[..., None])  # beta k e^G, per value head
    uw = _unit_lower_inverse(a) @ mx.concatenate([v * beta[..., None], k_b], axis=-1)
    qe = ungrp(q[:, :, None] * grp(ecum)[..., None])  # q e^G
    wq = mx.concatenate([uw[..., dv:], qe], axis=-2)
    kd = ungrp(k[:, :, None] * grp(decay[..., -1, :])[..., None])  # decay[-1,j] = e^(G_C-G_j)
    return wq, uw[..., :dv], p, kd, ecum[..., -1]


def _chunk_size_for(length: int, chunk_size: int, any_size: bool) -> int:
    """The chunk length C for an input of L tokens: with any_size (the inverse takes any
    C) the fewest chunks of at most chunk_size, of equal length (the last one padded by
    less than one token per chunk), else the next power of two >= L up to chunk_size.
    Padding is what a short input costs here, as for the small prompt chunks that run
    next to decode rows (bench/README.md, b5379f3: 5-33% of the DeltaNet core's time)."""
    if any_size:
        chunks = -(-length // chunk_size)
        return -(-length // chunks)
    return min(chunk_size, 1 << max(0, (length - 1).bit_length()))


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
    chunk_size: int = 64,
) -> tuple[mx.array, mx.array]:
    """Chunked WY/UT form: batched matmuls per chunk, a Python loop over chunks only.

    chunk_size must be a power of two (the block inverse halves it); L need not be a
    multiple of it. Masked and right-padding steps get beta = g = 0 and q = k = v = 0,
    which makes them exact no-ops on the state (their rows and columns of A, u, w, kd are
    exactly 0, their decay exactly 1) and their y exactly 0.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    out_dtype = v.dtype
    b, length, hv, dv = v.shape
    q, k, v, g, beta, s = _as_f32(q, k, v, g, beta, state, expand=False)
    if length == 0:
        return mx.zeros((b, 0, hv, dv), out_dtype), s
    if mask is not None:
        m = mask.astype(mx.bool_)
        q, k, v = (mx.where(m[..., None, None], x, 0.0) for x in (q, k, v))
        g, beta = (mx.where(m[..., None], x, 0.0) for x in (g, beta))
    c = _chunk_size_for(length, chunk_size, _lapack_inverse())
    pad = -length % c
    wq, u, p, kd, decay_last = _chunk_terms(*(_to_chunks(x, pad, c) for x in (q, k, v, g, beta)))
    ys = []
    for i in range(wq.shape[2]):  # sequential over chunks only; each op batched over B, Hv
        r = wq[:, :, i] @ s.swapaxes(-1, -2)  # [B, Hv, 2C, Dv] = [w; q e^G] S^T
        v_new = u[:, :, i] - r[..., :c, :]  # [B, Hv, C, Dv]
        ys.append(r[..., c:, :] + p[:, :, i] @ v_new)
        s = decay_last[:, :, i, None, None] * s + v_new.swapaxes(-1, -2) @ kd[:, :, i]
    y = mx.stack(ys, axis=2).reshape(b, hv, -1, dv)[:, :, :length]  # [B, Hv, L, Dv]
    return y.swapaxes(1, 2).astype(out_dtype), s


# (Hk, Hv) pairs for which mlx 0.32.4's Metal gated_delta_update runs its own kernels (with
# Dk = Dv = 128, no mask); anything else silently takes its per-token op loop, so those go
# to the chunked path instead. Qwen3.5 0.8B/2B (16, 16) and 122B/397B (16, 64) are not in
# it on 0.32.4 (later mlx versions add them): extend this set when upgrading mlx.
_METAL_FAST_HEADS = frozenset({(24, 24), (32, 32), (16, 32), (16, 48)})


def _use_metal_fast(k: mx.array, v: mx.array, mask: mx.array | None) -> bool:
    """True when mx.fast.gated_delta_update would run a real Metal kernel."""
    if mask is not None or current_platform().device != "metal":
        return False
    heads = (k.shape[2], v.shape[2])
    return k.shape[-1] == 128 and v.shape[-1] == 128 and heads in _METAL_FAST_HEADS


def _gated_delta_fast(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """mx.fast.gated_delta_update (Apple's Metal kernels; an op loop elsewhere).

    Its gamma is the LINEAR decay exp(g); its state is [B, Hv, Dv, Dk] whatever its
    docstring says. It expands Hk -> Hv itself.
    """
    out_dtype = v.dtype
    b, _, hv, dv = v.shape
    if state is None:
        state = mx.zeros((b, hv, dv, k.shape[-1]), F32)
    y, s = mx.fast.gated_delta_update(
        q.astype(F32),
        k.astype(F32),
        v.astype(F32),
        mx.exp(g.astype(F32)),
        beta.astype(F32),
        state.astype(F32),
    )
    return y.astype(out_dtype), s


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
    scan: bool = False,
    every_state: bool = False,
) -> tuple[mx.array, mx.array]:
    """Gated-DeltaNet over a block of L tokens; shapes in the module docstring.

    q, k: [B, L, Hk, Dk] (L2-normalised, q scaled by Dk**-0.5); v: [B, L, Hv, Dv];
    g: [B, L, Hv] log-decay <= 0; beta: [B, L, Hv] in (0, 1); state: [B, Hv, Dv, Dk]
    float32 (None = zeros); mask: [B, L] bool (True = real token) or None.
    Returns y [B, L, Hv, Dv] in v.dtype and the new state [B, Hv, Dv, Dk] float32.
    A masked step leaves the state exactly unchanged and yields y = 0.
    scan: on CUDA, L > 1 runs as one sequential-scan kernel (kernels/gated_delta_scan.py)
    instead of the chunked form's ~100 small kernels; ignored on other backends.
    every_state (unmasked input): the state after each token instead of the last, states
    [B, L, Hv, Dv, Dk] float32, states[:, t] after tokens 0..t (`_every_state`).
    """
    if every_state:
        assert mask is None, "every_state of masked input"
        return _every_state((q, k, v, g, beta), state, scan)
    if scan and v.shape[1] > 1 and current_platform().device == "cuda" and scan_supported(k, v):
        return gated_delta_scan(q, k, v, g, beta, state, mask)
    if v.shape[1] == 1:
        return gated_delta_step_fused(q, k, v, g, beta, state, mask)
    if _use_metal_fast(k, v, mask):
        return _gated_delta_fast(q, k, v, g, beta, state)
    return gated_delta_chunked(q, k, v, g, beta, state, mask)


def _every_state(
    qkvgb: tuple[mx.array, ...], state: mx.array | None, scan: bool
) -> tuple[mx.array, mx.array]:
    """`gated_delta(every_state=True)`: a speculative verify chunk (last token + k drafts)
    whose row accepts a drafts keeps slot a and never replays. scan: on CUDA, one scan
    kernel that writes every slot (kernels/gated_delta_scan.py); otherwise one decode
    step per token (L is k + 1 <= 4 here, so the loop is short)."""
    _, k, v, _, _ = qkvgb
    if scan and current_platform().device == "cuda" and scan_supported(k, v):
        return gated_delta_scan(*qkvgb, state, every_state=True)
    ys, states = [], []
    for t in range(v.shape[1]):
        y, state = gated_delta_step_fused(*(x[:, t : t + 1] for x in qkvgb), state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states, axis=1)
