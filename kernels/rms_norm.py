"""RMSNorm of half-precision activations with float32 gains, as one kernel.

    x [..., D] (any float dtype), weight [D] float32 -> [..., D] in x's dtype
    out = weight * x / sqrt(mean(x^2) + eps), computed in float32

Qwen3.5's gains are 1 + w folded in float32 (bf16 would round them to steps of 2^-7), and
HF normalises in float32 and multiplies by the float32 gain before casting back. As MLX
ops that is three kernels on the GPU (x to float32, mx.fast.rms_norm, back to x's dtype):
a decode step has ~60 norms and costs about its kernel launches there
(bench/decode_graph.py). This reads x once, sums in float32 and writes x's dtype.

Backends (by the platform profile, kernels/platform.py `fused_rms_norm`): CUDA ->
`mx.fast.cuda_kernel`; Metal -> the same algorithm as `mx.fast.metal_kernel` (never run
here: no Mac); CPU, switched off, or float32 input -> `rms_norm_ops` (on the CPU the
model computes in float32, where the casts are no-ops).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable

import mlx.core as mx

from deltaserve.kernels.jit import kernel_name
from deltaserve.kernels.platform import current_platform

__all__ = ["float_bits", "rms_norm", "rms_norm_ops"]

_THREADS = 256  # per row (one block / threadgroup per row)


def rms_norm_ops(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """The reference: float32 ops, cast back to x's dtype."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight, eps).astype(x.dtype)


_CUDA_SOURCE = """
  constexpr int NW = THREADS / 32;
  __shared__ float scratch[NW];
  const size_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const T* xr = x + row * D;
  float ss = 0.f;
  for (int i = tid; i < D; i += THREADS) {
    const float v = static_cast<float>(xr[i]);
    ss += v * v;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
  }
  if ((tid & 31) == 0) {
    scratch[tid >> 5] = ss;
  }
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    total += scratch[i];
  }
  const float scale = rsqrtf(total / float(D) + __int_as_float(EPS_BITS));
  for (int i = tid; i < D; i += THREADS) {
    out[row * D + i] = static_cast<T>(weight[i] * (static_cast<float>(xr[i]) * scale));
  }
"""

_METAL_SOURCE = """
  constexpr int NW = THREADS / 32;
  threadgroup float scratch[NW];
  const uint row = threadgroup_position_in_grid.x;
  const uint tid = thread_position_in_threadgroup.x;
  const device T* xr = x + row * D;
  float ss = 0.0f;
  for (uint i = tid; i < D; i += THREADS) {
    const float v = static_cast<float>(xr[i]);
    ss += v * v;
  }
  ss = simd_sum(ss);
  if ((tid & 31) == 0) {
    scratch[tid >> 5] = ss;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (int i = 0; i < NW; ++i) {
    total += scratch[i];
  }
  const float scale = metal::rsqrt(total / float(D) + as_type<float>(EPS_BITS));
  for (uint i = tid; i < D; i += THREADS) {
    out[row * D + i] = static_cast<T>(weight[i] * (static_cast<float>(xr[i]) * scale));
  }
"""


@functools.cache
def _kernel(backend: str) -> Callable[..., list[mx.array]]:
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    source = _CUDA_SOURCE if backend == "cuda" else _METAL_SOURCE
    return make(
        name=kernel_name("deltaserve_rms_norm", source),
        input_names=["x", "weight"],
        output_names=["out"],
        source=source,
    )


def float_bits(x: float) -> int:
    """The bits of float32(x) as an int (a kernel template argument), computed in Python:
    no MLX op, so no evaluation on the stream from inside a step's graph building."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """weight * rmsnorm(x) in float32, returned in x's dtype (shapes in the docstring)."""
    profile = current_platform()
    fits = x.dtype != mx.float32 and weight.dtype == mx.float32 and x.size
    if not (profile.fused_rms_norm and fits):  # the CPU, switched off, or no cast to save
        return rms_norm_ops(x, weight, eps)
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight {weight.shape} must be [{d}] for x {x.shape}")
    rows = x.size // d
    template = [("D", d), ("THREADS", _THREADS), ("EPS_BITS", float_bits(eps)), ("T", x.dtype)]
    (out,) = _kernel(profile.device)(
        inputs=[x, weight],
        template=template,
        grid=(rows * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return out
