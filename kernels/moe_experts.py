"""Routed experts of an MoE decode step as two CUDA kernels over 4-bit packed weights.

    y[t] = sum_j score[t, j] * down_e (silu(gate_e x[t]) * up_e x[t]),  e = idx[t, j]

x [N, H], idx [N, k] (expert ids), score [N, k] -> y [N, H] in x.dtype. Each expert
projection is MLX affine-quantized ([E, out, in * bits / 32] uint32 codes, scales and biases
[E, out, in / group_size]), 4-bit, as mlx-community's Qwen3.5 MoE checkpoints hold them.

Why: for a few rows per expert mlx-cuda 0.32's gather_qmm runs its tiled qmm_sm80 kernel
with a 16-row tile over gathered single rows; a decode step of the 35B-A3B shape spends
~0.3 ms of GPU time per layer in its 5 such calls (3 expert projections, the shared expert's
2) at B=16 (torch.profiler, bench/moe_profile.py). Here one warp computes one output of one
row as a dot product straight from the packed codes (kernel 1: gate and up together,
silu(g) * u; kernel 2: down for all k experts of a token, weighted by the scores and summed
in float32): 2 launches instead of ~10, no sort, no row gathers.

Status (H200, mlx-cuda 0.32.4, random 4-bit weights at the 35B-A3B expert shape, E=256,
H=2048, I=512, k=8): equal to `reference` within 1e-4 (float32) / 1e-2 (bf16) of the largest
output; the routed experts of one layer take 0.078 ms at B=1 and 0.303 ms at B=16 per call
of a 20-call chain, where the gathered path measured 0.13 / 0.29-0.33 ms (another run, bf16
scales). Not faster at B=16, and never measured inside the engine: off unless
DELTASERVE_MOE_KERNEL=1. Each lane loads x element by element and its scales and biases
scattered; vector loads and several rows per warp are the next things to try.

`supported` says when it applies (enabled, CUDA, 4-bit affine, at most MAX_ROWS rows);
elsewhere `reference` (plain MLX: dequantize, matmul) is the same computation, and is what
the CPU tests compare the model's own path against; tests/test_kernel_moe_experts.py
compares the kernel to it on a CUDA machine.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from deltaserve.kernels.jit import kernel_name
from deltaserve.kernels.platform import current_platform

# Rows (tokens x k) up to which the kernels replace gather_qmm (decode sizes). Prefill
# sorts rows by expert and takes gather_qmm's grouped GEMM, which reuses each expert's
# weights over its rows; these kernels read the weights once per row.
MAX_ROWS = 256
ENABLED = os.environ.get("DELTASERVE_MOE_KERNEL", "0") == "1"
_WARPS = 8  # output rows per block (one warp each)

_HEADER = """
namespace deltaserve_moe {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// Dot product of one packed 4-bit row (WORDS uint32 words, groups of GS values with one
// scale and bias each) with a row of x, this lane's share: words lane, lane + 32, ...
template <int WORDS, int GS, typename Tx, typename Ts>
__device__ __forceinline__ float row_dot(
    const uint32_t* w, const Ts* s, const Ts* b, const Tx* x, int lane) {
  float acc = 0.f;
  for (int i = lane; i < WORDS; i += 32) {
    const int g = (i * 8) / GS;
    const float sc = static_cast<float>(s[g]);
    const float bi = static_cast<float>(b[g]);
    const uint32_t q = w[i];
    const Tx* xv = x + i * 8;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      acc += (static_cast<float>((q >> (4 * n)) & 15u) * sc + bi) * static_cast<float>(xv[n]);
    }
  }
  return acc;
}

}  // namespace deltaserve_moe
"""

# Template constants: HID (model width), INTER (expert width), GS (group size), TOPK (top-k),
# WARPS; To = x's dtype (output), Ts = the scales' dtype.
_GATE_UP = """
  constexpr int BLOCKS_PER_ROW = (INTER + WARPS - 1) / WARPS;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int r = blockIdx.x / BLOCKS_PER_ROW;          // (token, expert) row: t * TOPK + j
  const int o = (blockIdx.x % BLOCKS_PER_ROW) * WARPS + warp;  // output unit
  if (o >= INTER) {
    return;
  }
  const size_t w_row = size_t(idx[r]) * INTER + o;
  const auto* xr = x + size_t(r / TOPK) * HID;
  const size_t wq = w_row * (HID / 8), wg = w_row * (HID / GS);
  float g = deltaserve_moe::row_dot<HID / 8, GS>(gate_w + wq, gate_s + wg, gate_b + wg, xr, lane);
  float u = deltaserve_moe::row_dot<HID / 8, GS>(up_w + wq, up_s + wg, up_b + wg, xr, lane);
  g = deltaserve_moe::warp_sum(g);
  u = deltaserve_moe::warp_sum(u);
  if (lane == 0) {
    // as the gathered path rounds them: each projection in x's dtype, then silu(g) * u
    const float gr = static_cast<float>(static_cast<To>(g));
    const float ur = static_cast<float>(static_cast<To>(u));
    act[size_t(r) * INTER + o] = static_cast<To>(gr / (1.f + expf(-gr)) * ur);
  }
"""

_DOWN = """
  constexpr int BLOCKS_PER_ROW = (HID + WARPS - 1) / WARPS;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int t = blockIdx.x / BLOCKS_PER_ROW;           // token
  const int o = (blockIdx.x % BLOCKS_PER_ROW) * WARPS + warp;  // output unit
  if (o >= HID) {
    return;
  }
  float acc = 0.f;
  for (int j = 0; j < TOPK; ++j) {
    const int r = t * TOPK + j;
    const size_t w_row = size_t(idx[r]) * HID + o;
    const size_t wq = w_row * (INTER / 8), wg = w_row * (INTER / GS);
    acc += static_cast<float>(score[r]) * deltaserve_moe::row_dot<INTER / 8, GS>(
        down_w + wq, down_s + wg, down_b + wg, act + size_t(r) * INTER, lane);
  }
  acc = deltaserve_moe::warp_sum(acc);
  if (lane == 0) {
    y[size_t(t) * HID + o] = static_cast<To>(acc);
  }
"""


@functools.cache
def _kernels():
    gate_up = mx.fast.cuda_kernel(
        name=kernel_name("deltaserve_moe_gate_up", _GATE_UP, _HEADER),
        input_names=["x", "idx", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b"],
        output_names=["act"],
        source=_GATE_UP,
        header=_HEADER,
    )
    down = mx.fast.cuda_kernel(
        name=kernel_name("deltaserve_moe_down", _DOWN, _HEADER),
        input_names=["act", "idx", "score", "down_w", "down_s", "down_b"],
        output_names=["y"],
        source=_DOWN,
        header=_HEADER,
    )
    return gate_up, down


def _on_cuda() -> bool:
    return current_platform().device == "cuda"


def supported(experts, rows: int) -> bool:
    """Whether the kernels run these QuantizedSwitchExperts for `rows` (token, expert) rows."""
    if not ENABLED or rows > MAX_ROWS or not _on_cuda():
        return False
    projections = (experts.gate_proj, experts.up_proj, experts.down_proj)
    for p in projections:
        if p.mode != "affine" or p.bits != 4 or p.group_size not in (32, 64, 128):
            return False
    inter, hidden = experts.gate_proj.weight.shape[1], experts.down_proj.weight.shape[1]
    return hidden % experts.gate_proj.group_size == 0 and inter % experts.down_proj.group_size == 0


def moe_experts(x: mx.array, indices: mx.array, scores: mx.array, experts) -> mx.array:
    """x [N, H], indices [N, k], scores [N, k] -> [N, H] (x.dtype) through the kernels;
    `experts` is a QuantizedSwitchExperts that `supported` accepted."""
    n, k = indices.shape
    gate, up, down = experts.gate_proj, experts.up_proj, experts.down_proj
    hidden, inter = x.shape[1], gate.weight.shape[1]
    idx = indices.reshape(-1).astype(mx.uint32)
    gate_up, down_kernel = _kernels()
    common = [("HID", hidden), ("INTER", inter), ("TOPK", k), ("WARPS", _WARPS), ("To", x.dtype)]
    threads = 32 * _WARPS
    (act,) = gate_up(
        inputs=[x, idx, gate.weight, gate.scales, gate.biases, up.weight, up.scales, up.biases],
        template=[*common, ("GS", gate.group_size), ("Ts", gate.scales.dtype)],
        grid=(n * k * -(-inter // _WARPS) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(n * k, inter)],
        output_dtypes=[x.dtype],
    )
    (y,) = down_kernel(
        inputs=[act, idx, scores.reshape(-1).astype(mx.float32), down.weight, down.scales,
                down.biases],
        template=[*common, ("GS", down.group_size), ("Ts", down.scales.dtype)],
        grid=(n * -(-hidden // _WARPS) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(n, hidden)],
        output_dtypes=[x.dtype],
    )  # fmt: skip
    return y


def reference(x: mx.array, indices: mx.array, scores: mx.array, experts) -> mx.array:
    """The same computation in plain MLX ops (any device): dequantize each token's experts,
    matmul; projections rounded to x.dtype as the kernels round them, the weighted sum
    over k in float32."""

    def dense(p, ids: mx.array) -> mx.array:  # [N, k, out, in] in float32
        w = mx.dequantize(p.weight[ids], p.scales[ids], p.biases[ids], p.group_size, p.bits)
        return w.astype(mx.float32)

    xf = x.astype(mx.float32)[:, None, :, None]  # [N, 1, H, 1]
    g = (dense(experts.gate_proj, indices) @ xf)[..., 0].astype(x.dtype).astype(mx.float32)
    u = (dense(experts.up_proj, indices) @ xf)[..., 0].astype(x.dtype).astype(mx.float32)
    act = (g * mx.sigmoid(g) * u).astype(x.dtype).astype(mx.float32)  # [N, k, I]
    out = (dense(experts.down_proj, indices) @ act[..., None])[..., 0]  # [N, k, H]
    return (out * scores.astype(mx.float32)[..., None]).sum(axis=1).astype(x.dtype)
