"""Fused Gated-DeltaNet decode step: one read and one write of the recurrent state.

Drop-in for `gated_delta_step` (kernels/gated_delta_reference.py; same signature, shapes, dtypes):
    q, k  [B, 1, Hk, Dk]   L2-normalised; q already scaled by Dk**-0.5
    v     [B, 1, Hv, Dv]   y comes back in v.dtype
    g     [B, 1, Hv]       log-decay;  beta [B, 1, Hv]
    state [B, Hv, Dv, Dk]  float32 (None = zeros); the new state is float32
    mask  [B, 1] bool      False: that row's state is copied bit for bit and y = 0

Per row and value head h (key head h // (Hv // Hk)), with a = exp(g):
    delta = beta (v - a S k) ;  S' = a S + delta k^T ;  y = S' q = a (S q) + delta (k.q)
so S k and S q are two dot products over the same registers: each state row is loaded
once, updated in registers and stored once.

Backends (by the platform profile, kernels/platform.py `fused_gated_delta_step`): CUDA ->
`mx.fast.cuda_kernel` below; Metal -> the same algorithm as `mx.fast.metal_kernel` (never
run here: no Mac; it follows mlx-lm's gated_delta Metal kernel layout); CPU or switched
off -> the compiled ops of `gated_delta_step`, which is also the reference the tests
compare against. A kernel that fails to compile raises at eval time (MLX JIT-compiles on
first use); nothing falls back silently.

Measured on an H200 (mlx-cuda 0.32.4, bench/gated_delta_step.py and a 50-step chain), per
step at Dk = Dv = 128: B=64, Hv=16 (67 MB of state) ~0.05 ms, B=64, Hv=32 ~0.08 ms, where
an MLX custom kernel that only copies the state takes 0.040 / 0.073 ms and the compiled
ops ~0.13 / ~0.22 ms. Other LANES (4-32) and BLOCK (64-256) sizes, and streaming cache hints,
were within noise of LANES=8, BLOCK=128 or slower.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from deltaserve.kernels.gated_delta_reference import gated_delta_step
from deltaserve.kernels.jit import kernel_name
from deltaserve.kernels.platform import current_platform

__all__ = ["gated_delta_step_fused"]

# CUDA layout: LANES lanes share one state row, each holding Dk / LANES floats as float4s
# interleaved (lane j owns float4s j, j + LANES, ...), so every load instruction of a warp
# reads whole 128-byte rows. A block of BLOCK threads covers BLOCK / LANES rows of one
# (b, h); the grid is B * Hv * ceil(Dv / ROWS) blocks (128 blocks even at B = 1, Hv = 16).
_LANES = 8
_BLOCK = 128

_CUDA_HEADER = """
namespace deltaserve_gdn {

// Sum over the LANES consecutive lanes that share one state row (xor butterfly).
template <int LANES>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

}  // namespace deltaserve_gdn
"""

# Template constants (set by the wrapper): Dk, Dv, Hk, Hv, LANES, BLOCK; Tq, Tk, Tv, Tg, Tb
# are the input dtypes: the signature already has them, but MLX caches compiled kernels by
# name + template arguments only, so each dtype combination needs its own template key.
# __MASKED__ is replaced by `!mask[b]` or `false` (the masked kernel has one more input).
_CUDA_SOURCE = """
  constexpr int NV4 = Dk / (4 * LANES);      // float4s per lane
  constexpr int ROWS = BLOCK / LANES;        // state rows per block
  constexpr int CHUNKS = (Dv + ROWS - 1) / ROWS;
  __shared__ float4 k4[Dk / 4];
  __shared__ float4 q4[Dk / 4];

  const int tid = threadIdx.x;
  const int n = blockIdx.x / CHUNKS;         // b * Hv + h
  const int b = n / Hv;
  const int hk = (n % Hv) / (Hv / Hk);
  const int lane = tid % LANES;
  const int row = (blockIdx.x % CHUNKS) * ROWS + tid / LANES;
  const bool live = row < Dv;
  const size_t s_off = (size_t(n) * Dv + (live ? row : 0)) * Dk;
  const float* src = state_in + s_off;
  float4* dst = reinterpret_cast<float4*>(state_out + s_off);
  const bool vec = (reinterpret_cast<size_t>(state_in) & 15) == 0;

  float4 s[NV4];
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const int c = 4 * (lane + i * LANES);
    if (!live) {
      s[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else if (vec) {
      s[i] = *reinterpret_cast<const float4*>(src + c);
    } else {
      s[i] = make_float4(src[c], src[c + 1], src[c + 2], src[c + 3]);
    }
  }

  if (__MASKED__) {  // uniform per block: copy the rows through, y = 0
    if (live) {
#pragma unroll
      for (int i = 0; i < NV4; ++i) {
        dst[lane + i * LANES] = s[i];
      }
      if (lane == 0) {
        y[size_t(n) * Dv + row] = static_cast<Tv>(0.f);
      }
    }
    return;
  }

  const size_t kq_off = (size_t(b) * Hk + hk) * Dk;
  float* kf = reinterpret_cast<float*>(k4);
  float* qf = reinterpret_cast<float*>(q4);
  for (int i = tid; i < Dk; i += BLOCK) {
    kf[i] = static_cast<float>(k[kq_off + i]);
    qf[i] = static_cast<float>(q[kq_off + i]);
  }
  __syncthreads();

  float sk = 0.f, sq = 0.f, kq = 0.f;
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const float4 kk = k4[lane + i * LANES];
    const float4 qq = q4[lane + i * LANES];
    sk += s[i].x * kk.x + s[i].y * kk.y + s[i].z * kk.z + s[i].w * kk.w;
    sq += s[i].x * qq.x + s[i].y * qq.y + s[i].z * qq.z + s[i].w * qq.w;
    kq += kk.x * qq.x + kk.y * qq.y + kk.z * qq.z + kk.w * qq.w;
  }
  sk = deltaserve_gdn::row_sum<LANES>(sk);
  sq = deltaserve_gdn::row_sum<LANES>(sq);
  kq = deltaserve_gdn::row_sum<LANES>(kq);

  const float a = expf(static_cast<float>(g[n]));
  const float v_row = live ? static_cast<float>(v[size_t(n) * Dv + row]) : 0.f;
  const float delta = static_cast<float>(beta[n]) * (v_row - a * sk);
  if (!live) {
    return;
  }
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const float4 kk = k4[lane + i * LANES];
    float4 o;
    o.x = a * s[i].x + delta * kk.x;
    o.y = a * s[i].y + delta * kk.y;
    o.z = a * s[i].z + delta * kk.z;
    o.w = a * s[i].w + delta * kk.w;
    dst[lane + i * LANES] = o;
  }
  if (lane == 0) {
    y[size_t(n) * Dv + row] = static_cast<Tv>(a * sq + delta * kq);
  }
"""

# Metal: mlx-lm's layout (one 32-lane simdgroup per state row, Dk / 32 floats per lane),
# same algorithm. Untested here (no Metal device); grid (32, Dv, B * Hv), groups (32, 4, 1).
_METAL_SOURCE = """
  constexpr int n_per_t = Dk / 32;
  const uint n = thread_position_in_grid.z;  // b * Hv + h
  const uint b = n / Hv;
  const uint hk = (n % Hv) / (Hv / Hk);
  const uint dk_idx = thread_position_in_threadgroup.x;
  const uint dv_idx = thread_position_in_grid.y;
  const device float* i_state = state_in + (n * Dv + dv_idx) * Dk;
  device float* o_state = state_out + (n * Dv + dv_idx) * Dk;
  float s[n_per_t];
  for (int i = 0; i < n_per_t; ++i) {
    s[i] = i_state[n_per_t * dk_idx + i];
  }
  if (__MASKED__) {
    for (int i = 0; i < n_per_t; ++i) {
      o_state[n_per_t * dk_idx + i] = s[i];
    }
    if (thread_index_in_simdgroup == 0) {
      y[n * Dv + dv_idx] = static_cast<Tv>(0.0f);
    }
    return;
  }
  const uint kq_off = (b * Hk + hk) * Dk;
  const float a = metal::exp(static_cast<float>(g[n]));
  float sk = 0.0f, sq = 0.0f, kq = 0.0f;
  for (int i = 0; i < n_per_t; ++i) {
    const uint c = kq_off + n_per_t * dk_idx + i;
    const float kk = static_cast<float>(k[c]);
    const float qq = static_cast<float>(q[c]);
    sk += s[i] * kk;
    sq += s[i] * qq;
    kq += kk * qq;
  }
  sk = simd_sum(sk);
  sq = simd_sum(sq);
  kq = simd_sum(kq);
  const float v_row = static_cast<float>(v[n * Dv + dv_idx]);
  const float delta = static_cast<float>(beta[n]) * (v_row - a * sk);
  for (int i = 0; i < n_per_t; ++i) {
    const float kk = static_cast<float>(k[kq_off + n_per_t * dk_idx + i]);
    o_state[n_per_t * dk_idx + i] = a * s[i] + delta * kk;
  }
  if (thread_index_in_simdgroup == 0) {
    y[n * Dv + dv_idx] = static_cast<Tv>(a * sq + delta * kq);
  }
"""

_INPUTS = ["q", "k", "v", "g", "beta", "state_in"]
_OUTPUTS = ["y", "state_out"]


@functools.cache
def _kernel(backend: str, masked: bool) -> Callable[..., list[mx.array]]:
    """The CUDA or Metal kernel (built once per backend and mask flavour)."""
    if backend == "cuda":
        make, source, extra = mx.fast.cuda_kernel, _CUDA_SOURCE, {"header": _CUDA_HEADER}
    else:
        make, source, extra = mx.fast.metal_kernel, _METAL_SOURCE, {}
    source = source.replace("__MASKED__", "!mask[b]" if masked else "false")
    return make(
        name=kernel_name("deltaserve_gdn_step", source, extra.get("header", "")),
        input_names=_INPUTS + (["mask"] if masked else []),
        output_names=_OUTPUTS,
        source=source,
        **extra,
    )


def _check_shapes(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array) -> None:
    b, length, hv, _ = v.shape
    if length != 1:
        raise ValueError(f"gated_delta_step_fused needs L == 1, got L = {length}")
    if q.shape != k.shape or q.shape[:2] != (b, 1) or q.ndim != 4:
        raise ValueError(f"q {q.shape} and k {k.shape} must both be [B, 1, Hk, Dk], B = {b}")
    if hv % k.shape[2]:
        raise ValueError(f"Hv={hv} is not a multiple of Hk={k.shape[2]}")
    if g.shape != (b, 1, hv) or beta.shape != (b, 1, hv):
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be [B, 1, Hv]")


def _gpu_step(
    backend: str,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """Launches the CUDA or Metal kernel; inputs already checked, state float32."""
    b, _, hv, dv = v.shape
    hk, dk = k.shape[2:]
    if dk % (4 * _LANES if backend == "cuda" else 32):
        raise ValueError(f"the fused step needs Dk % 32 == 0, got Dk = {dk}")
    inputs = [q, k, v, g, beta, state]
    if mask is not None:
        inputs.append(mx.broadcast_to(mask.astype(mx.bool_), (b, 1)).reshape(b))
    template = [("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv)]
    template += [(f"T{c}", x.dtype) for c, x in zip("qkvgb", inputs, strict=False)]
    if backend == "cuda":
        rows = _BLOCK // _LANES
        grid = (b * hv * -(-dv // rows) * _BLOCK, 1, 1)
        kernel, group = _kernel(backend, mask is not None), (_BLOCK, 1, 1)
        template += [("LANES", _LANES), ("BLOCK", _BLOCK)]
    else:
        kernel, grid, group = _kernel(backend, mask is not None), (32, dv, b * hv), (32, 4, 1)
    y, s = kernel(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=group,
        output_shapes=[v.shape, state.shape],
        output_dtypes=[v.dtype, mx.float32],
    )
    return y, s


def gated_delta_step_fused(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One decode token (L == 1) for all rows and heads; shapes in the module docstring.

    Returns y [B, 1, Hv, Dv] in v.dtype and the new state [B, Hv, Dv, Dk] float32.
    """
    _check_shapes(q, k, v, g, beta)
    profile = current_platform()
    if not profile.fused_gated_delta_step:  # the CPU, or switched off: the reference
        return gated_delta_step(q, k, v, g, beta, state, mask)
    b, _, hv, dv = v.shape
    if state is None:
        state = mx.zeros((b, hv, dv, k.shape[-1]), mx.float32)
    elif state.dtype != mx.float32:
        state = state.astype(mx.float32)
    if state.shape != (b, hv, dv, k.shape[-1]):
        raise ValueError(f"state {state.shape} must be [B, Hv, Dv, Dk]")
    return _gpu_step(profile.device, q, k, v, g, beta, state, mask)
