"""A whole Gated-DeltaNet decode token after the input projection, as one kernel.

    proj       [B, P]          the fused input projection: qkv (C) | z (Hv*Dv) | b (Hv) | a (Hv)
    conv_state [B, K-1, C]     the conv tail (proj's dtype T)
    ssm        [B, Hv, Dv, Dk] float32 recurrent state
    conv_w     [C, K]; a_log, dt_bias [Hv] (float32); norm_w [Dv]
 -> y [B, Hv*Dv] (T, gated-normed: the input of out_proj), conv_state', ssm'

with C = 2*Hk*Dk + Hv*Dv. In order, per row: causal conv over the K-1 tail and the new
token + SiLU; L2-normalised q (scaled by Dk**-0.5) and k; beta = sigmoid(b);
g = -exp(a_log) * softplus(a + dt_bias); the gated delta rule on the state; then
norm_w * rmsnorm(y) * silu(z). It is `deltaserve.models.deltanet.deltanet_core` at L = 1 without a
mask, which on the GPU ran as ~15 kernels per layer (concat, conv, three for each L2 norm,
gates, copies of non-contiguous slices, the state update, three for the gated norm): a
decode step there costs about its kernel launches (bench/decode_graph.py), so the 18-24
DeltaNet layers of a model were most of them.

Layout (CUDA and Metal alike): one block per (row, value head), LANES * Dv threads.
Threads [0, Dk) compute the head's q channels, [Dk, 2 Dk) its k channels, [2 Dk, 2 Dk + Dv)
its v channels (conv + SiLU), rounded to T where the reference rounds; block sums give the
L2 norms; then LANES lanes per state row do the update as in kernels/gated_delta_fused.py
(one read, one write of the state); a last block sum gives the gated norm. Blocks of value
head h with h % (Hv / Hk) == 0 also write the q/k channels of the new conv tail.

`deltanet_decode_slots` runs the same token over a row's L columns in turn (a speculative
verify: the last token and its drafts), keeping the conv tail and state after each column
for the rollback: on CUDA one kernel whose columns are the decode kernel's, operation for
operation (the state stays in registers between them), where the model's eager core took
its conv views, norms, gates, the scan and stacks (`bench.step_kernels` counts a verify).

Backends (by the platform profile, kernels/platform.py `fused_deltanet_decode`): CUDA ->
`mx.fast.cuda_kernel`; Metal -> the same algorithm as `mx.fast.metal_kernel` (its source:
kernels/deltanet_decode_metal.py; never run here: no Mac); CPU or switched off ->
`deltanet_decode_ops`, plain MLX ops, which is the reference the tests compare the kernels
against (`deltanet_decode_slots_ops` for the many-column form, which Metal runs as the
decode kernel once a column).
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from deltaserve.kernels import fastmath
from deltaserve.kernels.deltanet_decode_metal import (
    CONV_CHANNEL,
    CONV_STORE,
    METAL_HEADER,
    METAL_SOURCE,
    conv_stage,
)
from deltaserve.kernels.gated_delta_reference import gated_delta_step
from deltaserve.kernels.jit import kernel_name
from deltaserve.kernels.platform import current_platform
from deltaserve.kernels.rms_norm import float_bits

__all__ = [
    "DecodeDims",
    "check_inputs",
    "deltanet_decode",
    "deltanet_decode_ops",
    "deltanet_decode_slots",
    "deltanet_decode_slots_ops",
    "supported",
]

_LANES = 8  # lanes per state row (as kernels/gated_delta_fused.py)


@dataclass(frozen=True)
class DecodeDims:
    """Static sizes of one DeltaNet layer (per tensor-parallel rank)."""

    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int
    kernel: int
    norm_eps: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def proj_dim(self) -> int:
        return self.conv_dim + self.num_v_heads * (self.head_v_dim + 2)


def supported(dims: DecodeDims) -> bool:
    """Whether the kernels take these sizes (every Qwen3.5 shape: Dk = Dv = 128)."""
    dk, dv = dims.head_k_dim, dims.head_v_dim
    block = _LANES * dv
    return (
        dk % (4 * _LANES) == 0
        and block % 32 == 0
        and block <= 1024
        and block >= 2 * dk + dv
        and dims.num_v_heads % dims.num_k_heads == 0
    )


def _l2(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def deltanet_decode_ops(
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """The reference: the same token as plain MLX ops (shapes in the module docstring)."""
    b, dtype = proj.shape[0], proj.dtype
    hk, dk, hv, dv = dims.num_k_heads, dims.head_k_dim, dims.num_v_heads, dims.head_v_dim
    c, vd = dims.conv_dim, hv * dv
    qkv, z = proj[:, :c], proj[:, c : c + vd]
    beta_in, a_in = proj[:, c + vd : c + vd + hv], proj[:, c + vd + hv :]
    full = mx.concatenate([conv_state.astype(dtype), qkv[:, None]], axis=1)  # [B, K, C]
    w = conv_w.astype(dtype)
    conv = full[:, 0] * w[:, 0]
    for j in range(1, dims.kernel):
        conv = conv + full[:, j] * w[:, j]
    conv = fastmath.silu(conv)
    q = _l2(conv[:, : hk * dk].reshape(b, 1, hk, dk).astype(mx.float32)) * dk**-0.5
    k = _l2(conv[:, hk * dk : 2 * hk * dk].reshape(b, 1, hk, dk).astype(mx.float32))
    v = conv[:, 2 * hk * dk :].reshape(b, 1, hv, dv)
    beta = fastmath.sigmoid(beta_in.astype(mx.float32))[:, None]
    a = a_in.astype(mx.float32) + dt_bias
    g = (-mx.exp(a_log) * mx.logaddexp(a, mx.zeros_like(a)))[:, None]
    y, ssm = gated_delta_step(q, k, v, g, beta, ssm)  # y [B, 1, Hv, Dv] in T
    normed = mx.fast.rms_norm(y[:, 0].astype(mx.float32), None, dims.norm_eps)
    gate = fastmath.silu(z.reshape(b, hv, dv).astype(mx.float32))
    out = (norm_w.astype(mx.float32) * normed * gate).astype(dtype).reshape(b, vd)
    return out, full[:, 1:], ssm


_CUDA_HEADER = """
namespace deltaserve_dn {

// Sum over the LANES consecutive lanes that share one state row (xor butterfly).
template <int LANES>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

// Sum of x over the whole block (every thread gets it); scratch holds NW floats.
template <int NW>
__device__ __forceinline__ float block_sum(float x, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  __syncthreads();  // earlier readers of scratch are done
  if ((threadIdx.x & 31) == 0) {
    scratch[threadIdx.x >> 5] = x;
  }
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    total += scratch[i];
  }
  return total;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

}  // namespace deltaserve_dn
"""

# The kernel's text in parts, shared by the decode kernel and its many-column form below.
# Template constants: Dk, Dv, Hk, Hv, K, LANES; T (proj dtype), Tw (conv_w), Tn (norm_w),
# EPS_BITS (norm eps as float bits: template arguments are integers).
_PREAMBLE = """
  using namespace deltaserve_dn;
  constexpr int BLOCK = LANES * Dv;
  constexpr int NW = BLOCK / 32;
  constexpr int NV4 = Dk / (4 * LANES);
  constexpr int QK = Hk * Dk;
  constexpr int C = 2 * QK + Hv * Dv;
  constexpr int VD = Hv * Dv;
  constexpr int P = C + VD + 2 * Hv;
  __shared__ float4 q4[Dk / 4];
  __shared__ float4 k4[Dk / 4];
  __shared__ float vs[Dv];
  __shared__ float scratch[NW];
  float* qf = reinterpret_cast<float*>(q4);
  float* kf = reinterpret_cast<float*>(k4);

  const int tid = threadIdx.x;
  const int n = blockIdx.x;  // b * Hv + h
  const int b = n / Hv;
  const int h = n % Hv;
  const int hk = h / (Hv / Hk);
"""

# 2. q and k scaled by their L2 norms, the gates (reads pr: the token's projection)
_GATES = """
  // 2. L2 norms of q and k (block sums), gates
  const float q_scale = rsqrtf(block_sum<NW>(x2q, scratch) + 1e-6f) * rsqrtf(float(Dk));
  const float k_scale = rsqrtf(block_sum<NW>(x2k, scratch) + 1e-6f);
  if (tid < Dk) {
    qf[tid] *= q_scale;
  } else if (tid < 2 * Dk) {
    kf[tid - Dk] *= k_scale;
  }
  const float beta = 1.f / (1.f + expf(-static_cast<float>(pr[C + VD + h])));
  const float ain = static_cast<float>(pr[C + VD + Hv + h]) + dt_bias[h];
  const float softplus = fmaxf(ain, 0.f) + log1pf(expf(-fabsf(ain)));
  const float a = expf(-expf(a_log[h]) * softplus);
  __syncthreads();
"""

# the thread's part of its state row (from src) into registers
_LOAD_STATE = """\
  const bool vec = (reinterpret_cast<size_t>(ssm) & 15) == 0;
  float4 s[NV4];
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const int c = 4 * (lane + i * LANES);
    s[i] = vec ? *reinterpret_cast<const float4*>(src + c)
               : make_float4(src[c], src[c + 1], src[c + 2], src[c + 3]);
  }
"""

# the row's dot products with k and q, and the delta rule's correction
_DOTS = """\
  float sk = 0.f, sq = 0.f, kq = 0.f;
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const float4 kk = k4[lane + i * LANES];
    const float4 qq = q4[lane + i * LANES];
    sk += s[i].x * kk.x + s[i].y * kk.y + s[i].z * kk.z + s[i].w * kk.w;
    sq += s[i].x * qq.x + s[i].y * qq.y + s[i].z * qq.z + s[i].w * qq.w;
    kq += kk.x * qq.x + kk.y * qq.y + kk.z * qq.z + kk.w * qq.w;
  }
  sk = row_sum<LANES>(sk);
  sq = row_sum<LANES>(sq);
  kq = row_sum<LANES>(kq);
  const float delta = beta * (vs[row] - a * sk);
"""

# 4. the gated norm, written to y at @Y@ (the token's row of y)
_GATED_NORM = """
  // 4. gated RMSNorm over the head's Dv outputs
  const float ss = block_sum<NW>(lane == 0 ? yr * yr : 0.f, scratch);
  if (lane == 0) {
    const float eps = __int_as_float(EPS_BITS);
    const float normed = yr * rsqrtf(ss / float(Dv) + eps);
    const float z = static_cast<float>(pr[C + h * Dv + row]);
    const float out = static_cast<float>(norm_w[row]) * normed * silu(z);
    y[@Y@ * VD + h * Dv + row] = static_cast<T>(out);
  }
"""

_CUDA_SOURCE = (
    _PREAMBLE
    + """\
  const T* pr = proj + size_t(b) * P;
  const T* cs = conv_state + size_t(b) * (K - 1) * C;
  T* co = conv_out + size_t(b) * (K - 1) * C;

  // 1. conv + SiLU of this head's channels; the new conv tail of those channels
"""
    + conv_stage("silu", "#pragma unroll\n")
    + _GATES
    + """
  // 3. the state update: LANES lanes per state row, one read and one write of the row
  const int lane = tid % LANES;
  const int row = tid / LANES;
  const size_t s_off = (size_t(n) * Dv + row) * Dk;
  const float* src = ssm + s_off;
  float4* dst = reinterpret_cast<float4*>(ssm_out + s_off);
"""
    + _LOAD_STATE
    + _DOTS
    + """\
#pragma unroll
  for (int i = 0; i < NV4; ++i) {
    const float4 kk = k4[lane + i * LANES];
    dst[lane + i * LANES] = make_float4(a * s[i].x + delta * kk.x, a * s[i].y + delta * kk.y,
                                        a * s[i].z + delta * kk.z, a * s[i].w + delta * kk.w);
  }
  // y rounded to T as the reference's state step returns it
  const float yr = static_cast<float>(static_cast<T>(a * sq + delta * kq));
"""
    + _GATED_NORM.replace("@Y@", "size_t(b)")
)

_INPUTS = ["proj", "conv_state", "ssm", "conv_w", "a_log", "dt_bias", "norm_w"]
_OUTPUTS = ["y", "conv_out", "ssm_out"]

# The same token, NT columns of a row in turn (a speculative verify: the last token and its
# drafts), each column's conv tail and state written to its own slot. The state row stays
# in registers between columns (one read of the state, NT writes); column t's conv window
# is positions t .. t+K-1 of [conv tail | the row's columns]. Per column it is the decode
# kernel above, operation for operation (the same parts), so a verify's columns equal NT
# decode steps bit for bit. The gated norm's block sums also end every thread's reads of
# q4, k4 and vs before the next column writes them. Template constants: the decode
# kernel's and NT. CUDA only (Metal runs the decode kernel once a column:
# `deltanet_decode_slots`).
_CUDA_SLOTS_SOURCE = (
    _PREAMBLE
    + """\
  const T* pb = proj + size_t(b) * NT * P;  // the row's NT columns
  const T* cs = conv_state + size_t(b) * (K - 1) * C;
"""
    + CONV_CHANNEL
    + """\
  // position i of [conv tail (K-1) | columns]: the channel's input there
  auto x_at = [&](int i) -> T {
    return i < K - 1 ? cs[i * C + ch] : pb[size_t(i - (K - 1)) * P + ch];
  };
  const int lane = tid % LANES;
  const int row = tid / LANES;
  const float* src = ssm + (size_t(n) * Dv + row) * Dk;
"""
    + _LOAD_STATE
    + """
  for (int t = 0; t < NT; ++t) {
    const T* pr = pb + size_t(t) * P;
    // 1. conv + SiLU over positions t .. t+K-1, rounded as the reference; the tail after it
    float x2q = 0.f, x2k = 0.f;
    if (ch >= 0) {
      const float w0 = static_cast<float>(static_cast<T>(conv_w[ch * K]));
      T acc = static_cast<T>(static_cast<float>(x_at(t)) * w0);
#pragma unroll
      for (int j = 1; j < K; ++j) {
        const float x = static_cast<float>(x_at(t + j));
        const T prod = static_cast<T>(x * static_cast<float>(static_cast<T>(conv_w[ch * K + j])));
        acc = static_cast<T>(static_cast<float>(acc) + static_cast<float>(prod));
      }
      const float val = static_cast<float>(static_cast<T>(silu(static_cast<float>(acc))));
"""
    + textwrap.indent(CONV_STORE, "  ")
    + """\
      if (write_tail) {
        T* co = conv_out + (size_t(b) * NT + t) * (K - 1) * C;
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
          co[j * C + ch] = x_at(t + 1 + j);
        }
      }
    }
"""
    + textwrap.indent(_GATES, "  ")
    + """
    // 3. the state update in registers, written to column t's slot
    float4* dst = reinterpret_cast<float4*>(
        ssm_out + (((size_t(b) * NT + t) * Hv + h) * Dv + row) * Dk);
"""
    + textwrap.indent(_DOTS, "  ")
    + """\
#pragma unroll
    for (int i = 0; i < NV4; ++i) {
      const float4 kk = k4[lane + i * LANES];
      s[i] = make_float4(a * s[i].x + delta * kk.x, a * s[i].y + delta * kk.y,
                         a * s[i].z + delta * kk.z, a * s[i].w + delta * kk.w);
      dst[lane + i * LANES] = s[i];
    }
    const float yr = static_cast<float>(static_cast<T>(a * sq + delta * kq));
"""
    + textwrap.indent(_GATED_NORM.replace("@Y@", "(size_t(b) * NT + t)"), "  ")
    + "  }\n"
)


@functools.cache
def _kernel(backend: str) -> Callable[..., list[mx.array]]:
    if backend == "cuda":
        make, source, header = mx.fast.cuda_kernel, _CUDA_SOURCE, _CUDA_HEADER
    else:
        make, source, header = mx.fast.metal_kernel, METAL_SOURCE, METAL_HEADER
    return make(
        name=kernel_name("deltaserve_dn_decode", source, header),
        input_names=_INPUTS,
        output_names=_OUTPUTS,
        source=source,
        header=header,
    )


@functools.cache
def _slots_kernel() -> Callable[..., list[mx.array]]:
    return mx.fast.cuda_kernel(
        name=kernel_name("deltaserve_dn_decode_slots", _CUDA_SLOTS_SOURCE, _CUDA_HEADER),
        input_names=_INPUTS,
        output_names=_OUTPUTS,
        source=_CUDA_SLOTS_SOURCE,
        header=_CUDA_HEADER,
    )


def check_inputs(
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
) -> None:
    """Raise ValueError unless the inputs fit `dims`: proj [B, (L,) P], conv_state
    [B, K-1, C], ssm [B, Hv, Dv, Dk] and weights of the layer's sizes. The kernels (here
    and kernels/deltanet_chunk.py) index every input by these sizes and size their state
    outputs from them: a state or weight of other sizes would be read (and the state
    written) out of bounds."""
    b, p = proj.shape[0], proj.shape[-1]
    c = dims.conv_dim
    if p != dims.proj_dim or conv_state.shape != (b, dims.kernel - 1, c):
        raise ValueError(f"proj {proj.shape} / conv_state {conv_state.shape} do not fit {dims}")
    ssm_shape = (b, dims.num_v_heads, dims.head_v_dim, dims.head_k_dim)
    if ssm.shape != ssm_shape:
        raise ValueError(f"ssm {ssm.shape} must be {ssm_shape} for proj {proj.shape}")
    weights = {
        "conv_w": (conv_w, c * dims.kernel),
        "a_log": (a_log, dims.num_v_heads),
        "dt_bias": (dt_bias, dims.num_v_heads),
        "norm_w": (norm_w, dims.head_v_dim),
    }
    for name, (x, size) in weights.items():
        if x.size != size:
            raise ValueError(f"{name} {x.shape} must hold {size} values for {dims}")


def deltanet_decode(
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """One decode token of a DeltaNet layer (shapes in the module docstring): the kernel on
    CUDA/Metal, `deltanet_decode_ops` on the CPU. Raises ValueError on shapes the kernel
    does not take (`supported`)."""
    check_inputs(dims, proj, conv_state, ssm, conv_w, a_log, dt_bias, norm_w)
    b = proj.shape[0]
    profile = current_platform()
    args = (proj, conv_state.astype(proj.dtype), ssm.astype(mx.float32), conv_w, a_log, dt_bias)
    if not profile.fused_deltanet_decode:  # the CPU, or switched off: the reference
        return deltanet_decode_ops(dims, *args, norm_w)
    if not supported(dims):
        raise ValueError(f"no fused DeltaNet decode kernel for {dims}")
    hv, dv = dims.num_v_heads, dims.head_v_dim
    y, conv, state = _kernel(profile.device)(
        inputs=[*args, norm_w],
        template=_template(dims, proj, conv_w, a_log, dt_bias, norm_w),
        grid=(b * hv * _LANES * dv, 1, 1),
        threadgroup=(_LANES * dv, 1, 1),
        output_shapes=[(b, hv * dv), conv_state.shape, ssm.shape],
        output_dtypes=[proj.dtype, proj.dtype, mx.float32],
    )
    return y, conv, state


def _template(
    dims: DecodeDims,
    proj: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
) -> list[tuple[str, int | mx.Dtype]]:
    """The kernels' template arguments: sizes, and every input's dtype (MLX caches
    compiled kernels by name + template only, and the signature's pointer types come
    from the dtypes)."""
    hk, dk, hv, dv = dims.num_k_heads, dims.head_k_dim, dims.num_v_heads, dims.head_v_dim
    template: list[tuple[str, int | mx.Dtype]] = [
        ("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv), ("K", dims.kernel),
    ]  # fmt: skip
    template += [("LANES", _LANES), ("EPS_BITS", float_bits(dims.norm_eps))]
    template += [("T", proj.dtype), ("Tw", conv_w.dtype), ("Tn", norm_w.dtype)]
    template += [("Ta", a_log.dtype), ("Tdt", dt_bias.dtype)]
    return template


def deltanet_decode_slots_ops(
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """The reference of `deltanet_decode_slots`: `deltanet_decode_ops` a column at a time."""
    return _column_by_column(deltanet_decode_ops, dims, proj, conv_state, ssm, conv_w, a_log,
                             dt_bias, norm_w)  # fmt: skip


def _column_by_column(
    step: Callable[..., tuple[mx.array, mx.array, mx.array]],
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    *weights: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """`step` (a decode token) over proj's columns in turn; y, conv tails and states
    stacked by column."""
    ys, convs, states = [], [], []
    for t in range(proj.shape[1]):
        y, conv_state, ssm = step(dims, proj[:, t], conv_state, ssm, *weights)
        ys.append(y)
        convs.append(conv_state)
        states.append(ssm)
    return mx.stack(ys, axis=1), mx.stack(convs, axis=1), mx.stack(states, axis=1)


def deltanet_decode_slots(
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """A decode token for each of proj's L columns in turn (a speculative verify's last
    token and drafts), keeping what follows each: proj [B, L, P] -> y [B, L, Hv*Dv], the
    conv tail after each column [B, L, K-1, C] and the state after each [B, L, Hv, Dv, Dk]
    (RecurrentState.slots). CUDA: one kernel (`_CUDA_SLOTS_SOURCE`); Metal: the decode
    kernel once a column; the CPU or switched off: `deltanet_decode_slots_ops`. Raises
    ValueError as `deltanet_decode`."""
    check_inputs(dims, proj, conv_state, ssm, conv_w, a_log, dt_bias, norm_w)
    profile = current_platform()
    weights = (conv_w, a_log, dt_bias, norm_w)
    if not profile.fused_deltanet_decode:  # the CPU, or switched off: the reference
        return deltanet_decode_slots_ops(dims, proj, conv_state, ssm, *weights)
    if profile.device != "cuda":
        return _column_by_column(deltanet_decode, dims, proj, conv_state, ssm, *weights)
    if not supported(dims):
        raise ValueError(f"no fused DeltaNet decode kernel for {dims}")
    b, columns = proj.shape[:2]
    hv, dv = dims.num_v_heads, dims.head_v_dim
    args = (proj, conv_state.astype(proj.dtype), ssm.astype(mx.float32), *weights)
    template = _template(dims, proj, conv_w, a_log, dt_bias, norm_w) + [("NT", columns)]
    y, conv, state = _slots_kernel()(
        inputs=list(args),
        template=template,
        grid=(b * hv * _LANES * dv, 1, 1),
        threadgroup=(_LANES * dv, 1, 1),
        output_shapes=[
            (b, columns, hv * dv),
            (b, columns, *conv_state.shape[1:]),
            (b, columns, *ssm.shape[1:]),
        ],
        output_dtypes=[proj.dtype, proj.dtype, mx.float32],
    )
    return y, conv, state
