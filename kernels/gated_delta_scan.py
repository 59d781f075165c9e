"""Gated-DeltaNet over a block of L tokens as one kernel: a sequential scan per state row.

Same contract as `deltaserve.kernels.gated_delta.gated_delta` for L >= 1:
    q, k  [B, L, Hk, Dk]   L2-normalised; q already scaled by Dk**-0.5
    v     [B, L, Hv, Dv]   y comes back in v.dtype
    g     [B, L, Hv]       log-decay;  beta [B, L, Hv]
    state [B, Hv, Dv, Dk]  float32 (None = zeros); the new state is float32
    mask  [B, L] bool      False: the step leaves the state exactly unchanged and y = 0

Why a scan and not the chunked WY form on CUDA: a prompt chunk's DeltaNet core ran as
~100 small kernels per layer there (the chunk decays, the block inverse, per-chunk
matmuls), so a 16-token chunk of the 0.8B shape cost as much as a 256-token one and a
step that added one to the decode rows cost ~5x a decode step (bench/mixed_step.py). The
rows of the state are independent given the token's k, q, v, g and beta:
    S_r <- a S_r + beta (v_r - a S_r.k) k ;  y_r = S_r.q      (a = exp(g))
so each row is held in registers by LANES lanes for the whole block of tokens, read once
and written once, and a token costs three dot products and an update: no block-level
synchronisation at all. This is the per-step recurrence itself (the test oracle's
arithmetic), not an approximation of it.

Backends: CUDA -> `mx.fast.cuda_kernel` below. Everywhere else `gated_delta_scan` is
`gated_delta_reference` (the plain per-step loop): the dispatcher (`gated_delta`) only
sends CUDA work here; Metal keeps Apple's `mx.fast.gated_delta_update` and the chunked
form, the CPU the chunked form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from deltaserve.kernels.gated_delta_fused import _CUDA_HEADER
from deltaserve.kernels.gated_delta_reference import gated_delta_reference
from deltaserve.kernels.jit import kernel_name
from deltaserve.kernels.platform import current_platform

__all__ = ["gated_delta_scan", "scan_supported"]

# As kernels/gated_delta_fused.py (whose row_sum header it shares): LANES lanes per state
# row, float4s interleaved so a warp's loads read whole rows; BLOCK / LANES rows per
# block; grid B * Hv * Dv / ROWS. TILE tokens' inputs at a time are staged in shared
# memory by the whole block (coalesced loads, one memory round trip per tile), so the
# sequential part of a token reads only shared memory: the per-token loop had waited on
# a global load (and, masked, on the mask's load before it) at every token. With PREFETCH
# the next tile's loads are issued into registers before this tile is scanned. Tile sizes
# by grid width, from bench.deltanet_scan on an H100 (bench/README.md): 16 tokens were
# fastest at 128-256 blocks (one or a few prompts), 4 at 2,048 (16 rows).
_LANES = 8
_BLOCK = 128
_TILE = 16  # tokens a tile when the grid is small
_TILE_WIDE = 4  # ... when it is wide: smaller tiles' shared memory keeps more blocks resident
_WIDE_BLOCKS = 512  # blocks from which a grid counts as wide
_PREFETCH = True

# Template constants: Dk, Dv, Hk, Hv, LANES, BLOCK, TILE, PREFETCH; Tq, Tk, Tv, Tg, Tb
# (input dtypes: MLX caches compiled kernels by name + template arguments). __SKIP__ is
# `!mask[bt]` or `false`. Every lane of a row takes the same branch, so the shuffles stay
# converged; a block's rows past Dv (none at Qwen3.5's Dv = 128) compute on zeros and
# store nothing, as every thread must reach the block's barriers.
_CUDA_SOURCE = """
  constexpr int NV4 = Dk / (4 * LANES);
  constexpr int ROWS = BLOCK / LANES;
  constexpr int CHUNKS = (Dv + ROWS - 1) / ROWS;
  __shared__ float4 k4[TILE][Dk / 4];
  __shared__ float4 q4[TILE][Dk / 4];
  __shared__ float v_t[TILE][ROWS];
  __shared__ float a_t[TILE];
  __shared__ float beta_t[TILE];
  __shared__ bool skip_t[TILE];

  const int tid = threadIdx.x;
  const int n = blockIdx.x / CHUNKS;  // b * Hv + h
  const int b = n / Hv;
  const int h = n % Hv;
  const int hk = h / (Hv / Hk);
  const int lane = tid % LANES;
  const int row0 = (blockIdx.x % CHUNKS) * ROWS;
  const int local = tid / LANES;
  const int row = row0 + local;
  const bool live = row < Dv;
  const size_t s_off = (size_t(n) * Dv + (live ? row : 0)) * Dk;
  const float* src = state_in + s_off;
  float* dst = state_out + s_off;

  float4 s[NV4];
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const int c = 4 * (lane + i * LANES);
    s[i] = live ? make_float4(src[c], src[c + 1], src[c + 2], src[c + 3])
                : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  const int L = steps[0];  // an input, not a template constant: one build for every L
  // Each thread's share of a tile's inputs, fetched into registers one tile ahead (when
  // PREFETCH) so their global round trip overlaps the tile before; then stashed into
  // shared memory between two barriers.
  constexpr int KQ_EACH = (TILE * Dk + BLOCK - 1) / BLOCK;
  constexpr int V_EACH = (TILE * ROWS + BLOCK - 1) / BLOCK;
  float rk[KQ_EACH], rq[KQ_EACH], rv[V_EACH];
  float ra = 0.f, rb = 0.f;
  bool rs = false;
  auto fetch = [&](int t0) {
    const int nt = min(TILE, L - t0);
#pragma unroll
    for (int j = 0; j < KQ_EACH; ++j) {
      const int i = tid + j * BLOCK;
      if (i < nt * Dk) {
        const size_t off = ((size_t(b) * L + t0 + i / Dk) * Hk + hk) * Dk + i % Dk;
        rk[j] = static_cast<float>(k[off]);
        rq[j] = static_cast<float>(q[off]);
      }
    }
#pragma unroll
    for (int j = 0; j < V_EACH; ++j) {
      const int i = tid + j * BLOCK;
      const int r = row0 + i % ROWS;
      if (i < nt * ROWS) {
        const size_t gh = (size_t(b) * L + t0 + i / ROWS) * Hv + h;
        rv[j] = r < Dv ? static_cast<float>(v[gh * Dv + r]) : 0.f;
      }
    }
    if (tid < nt) {
      const size_t bt = size_t(b) * L + t0 + tid;
      const size_t gh = bt * Hv + h;
      ra = static_cast<float>(g[gh]);
      rb = static_cast<float>(beta[gh]);
      rs = __SKIP__;
    }
  };
  if (PREFETCH && L > 0) {
    fetch(0);
  }
  for (int t0 = 0; t0 < L; t0 += TILE) {
    const int nt = min(TILE, L - t0);
    if (!PREFETCH) {
      fetch(t0);
    }
    __syncthreads();  // every row is done with the last tile
#pragma unroll
    for (int j = 0; j < KQ_EACH; ++j) {
      const int i = tid + j * BLOCK;
      if (i < nt * Dk) {
        reinterpret_cast<float*>(&k4[i / Dk][0])[i % Dk] = rk[j];
        reinterpret_cast<float*>(&q4[i / Dk][0])[i % Dk] = rq[j];
      }
    }
#pragma unroll
    for (int j = 0; j < V_EACH; ++j) {
      const int i = tid + j * BLOCK;
      if (i < nt * ROWS) {
        v_t[i / ROWS][i % ROWS] = rv[j];
      }
    }
    if (tid < nt) {
      a_t[tid] = expf(ra);
      beta_t[tid] = rb;
      skip_t[tid] = rs;
    }
    __syncthreads();
    if (PREFETCH && t0 + TILE < L) {
      fetch(t0 + TILE);  // in flight while this tile is scanned
    }
    for (int tt = 0; tt < nt; ++tt) {
      const size_t gh = (size_t(b) * L + t0 + tt) * Hv + h;  // (gh * Dv + row): y's index
      if (skip_t[tt]) {
        if (live && lane == 0) {
          y[gh * Dv + row] = static_cast<Tv>(0.f);
        }
        continue;
      }
      float4 kk[NV4];
      float sk = 0.f, sq = 0.f, kq = 0.f;
#pragma unroll
      for (int i = 0; i < NV4; ++i) {
        kk[i] = k4[tt][lane + i * LANES];
        const float4 qq = q4[tt][lane + i * LANES];
        sk += s[i].x * kk[i].x + s[i].y * kk[i].y + s[i].z * kk[i].z + s[i].w * kk[i].w;
        sq += s[i].x * qq.x + s[i].y * qq.y + s[i].z * qq.z + s[i].w * qq.w;
        kq += kk[i].x * qq.x + kk[i].y * qq.y + kk[i].z * qq.z + kk[i].w * qq.w;
      }
      sk = deltaserve_gdn::row_sum<LANES>(sk);
      sq = deltaserve_gdn::row_sum<LANES>(sq);
      kq = deltaserve_gdn::row_sum<LANES>(kq);
      const float a = a_t[tt];
      const float delta = beta_t[tt] * (v_t[tt][local] - a * sk);
#pragma unroll
      for (int i = 0; i < NV4; ++i) {
        s[i].x = a * s[i].x + delta * kk[i].x;
        s[i].y = a * s[i].y + delta * kk[i].y;
        s[i].z = a * s[i].z + delta * kk[i].z;
        s[i].w = a * s[i].w + delta * kk[i].w;
      }
      if (live && lane == 0) {
        y[gh * Dv + row] = static_cast<Tv>(a * sq + delta * kq);
      }
      if (live) {
        __STORE_STEP__
      }
    }
  }
  if (live) {
    __STORE_FINAL__
  }
"""

# Writes this row of the state s to `out`: after the last token (gated_delta_scan), or
# after every token into its own slot (every_state, OUT = that token's slot).
_STORE = """
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const int c = 4 * (lane + i * LANES);
    OUT[c] = s[i].x;
    OUT[c + 1] = s[i].y;
    OUT[c + 2] = s[i].z;
    OUT[c + 3] = s[i].w;
  }
"""
# The slot of token t: states_out [B, L, Hv, Dv, Dk] at (b, t, h, row).
_SLOT = "(states_out + ((gh * Dv + row) * Dk))"

_INPUTS = ["q", "k", "v", "g", "beta", "state_in", "steps"]
_OUTPUTS = ["y", "state_out"]


@functools.cache
def _kernel(masked: bool) -> Callable[..., list[mx.array]]:
    """The CUDA kernel, built once per mask flavour."""
    source = _CUDA_SOURCE.replace("__SKIP__", "!mask[bt]" if masked else "false")
    source = source.replace("__STORE_STEP__", "")
    source = source.replace("__STORE_FINAL__", _STORE.replace("OUT", "dst"))
    return mx.fast.cuda_kernel(
        name=kernel_name("deltaserve_gdn_scan", source, _CUDA_HEADER),
        input_names=_INPUTS + (["mask"] if masked else []),
        output_names=_OUTPUTS,
        source=source,
        header=_CUDA_HEADER,
    )


@functools.cache
def _states_kernel() -> Callable[..., list[mx.array]]:
    """The CUDA kernel that writes the state after every token (unmasked inputs only:
    a verify chunk has no padding); `dst` / `state_out` go unused."""
    source = _CUDA_SOURCE.replace("__SKIP__", "false")
    source = source.replace("__STORE_STEP__", _STORE.replace("OUT", _SLOT))
    source = source.replace("__STORE_FINAL__", "")
    source = source.replace("float* dst = state_out + s_off;", "")
    return mx.fast.cuda_kernel(
        name=kernel_name("deltaserve_gdn_scan_states", source, _CUDA_HEADER),
        input_names=_INPUTS,
        output_names=["y", "states_out"],
        source=source,
        header=_CUDA_HEADER,
    )


def scan_supported(k: mx.array, v: mx.array) -> bool:
    """Whether the CUDA kernel takes these sizes (every Qwen3.5 shape: Dk = Dv = 128)."""
    hk, dk = k.shape[2], k.shape[3]
    return dk % (4 * _LANES) == 0 and v.shape[2] % hk == 0


def _check_shapes(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array) -> None:
    b, length, hv, _ = v.shape
    if q.shape != k.shape or k.shape[:2] != (b, length):
        raise ValueError(f"q {q.shape} and k {k.shape} must both be [B, L, Hk, Dk] of v {v.shape}")
    if g.shape != (b, length, hv) or beta.shape != (b, length, hv):
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be [B, L, Hv]")


def _launch(
    kernel: Callable[..., list[mx.array]],
    qkvgb: tuple[mx.array, ...],
    state: mx.array | None,
    mask: mx.array | None,
    state_shape: tuple[int, ...],
) -> tuple[mx.array, mx.array]:
    """Run one of the kernels over [B, L] tokens (q, k, v, g, beta); its second output
    has `state_shape`."""
    q, k, v, g, beta = qkvgb
    b, length, hv, dv = v.shape
    hk, dk = k.shape[2], k.shape[3]
    if not scan_supported(k, v):
        raise ValueError(f"no DeltaNet scan kernel for k {k.shape}, v {v.shape}")
    if state is None:
        state = mx.zeros((b, hv, dv, dk), mx.float32)
    if state.shape != (b, hv, dv, dk):
        raise ValueError(f"state {state.shape} must be [B, Hv, Dv, Dk]")
    inputs = [q, k, v, g, beta, state.astype(mx.float32), mx.array([length], mx.int32)]
    if mask is not None:
        # The kernel reads mask[b * L + t]: a mask the reference broadcasts ([1, L], [B, 1])
        # is made a full [B, L] array first (a broadcast view is copied: row-contiguous).
        inputs.append(mx.broadcast_to(mask.astype(mx.bool_), (b, length)))
    template = [("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv)]
    blocks = b * hv * -(-dv // (_BLOCK // _LANES))
    tile = _TILE if blocks < _WIDE_BLOCKS else _TILE_WIDE
    template += [("LANES", _LANES), ("BLOCK", _BLOCK), ("TILE", tile)]
    template += [("PREFETCH", int(_PREFETCH))]
    template += [(f"T{c}", x.dtype) for c, x in zip("qkvgb", inputs, strict=False)]
    rows = _BLOCK // _LANES
    y, s = kernel(
        inputs=inputs,
        template=template,
        grid=(b * hv * -(-dv // rows) * _BLOCK, 1, 1),
        threadgroup=(_BLOCK, 1, 1),
        output_shapes=[v.shape, state_shape],
        output_dtypes=[v.dtype, mx.float32],
    )
    return y, s


def gated_delta_scan(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
    every_state: bool = False,
) -> tuple[mx.array, mx.array]:
    """L tokens for all rows and heads (shapes in the module docstring): the CUDA kernel
    on CUDA, the per-step reference loop elsewhere. Returns y [B, L, Hv, Dv] in v.dtype
    and the new state [B, Hv, Dv, Dk] float32.

    every_state (unmasked input): the state after EVERY token instead, [B, L, Hv, Dv, Dk],
    slot t being the state after tokens 0..t (a speculative verify: a row that accepts
    t drafts keeps slot t, no replay); the kernel variant writes each slot."""
    _check_shapes(q, k, v, g, beta)
    if current_platform().device != "cuda":
        return gated_delta_reference(q, k, v, g, beta, state, mask, every_state)
    b, length, hv, dv = v.shape
    if every_state:
        assert mask is None, "every_state of masked input"
        shape = (b, length, hv, dv, k.shape[3])
        return _launch(_states_kernel(), (q, k, v, g, beta), state, None, shape)
    shape = (b, hv, dv, k.shape[3])
    return _launch(_kernel(mask is not None), (q, k, v, g, beta), state, mask, shape)
