"""A Gated-DeltaNet prompt chunk after the input projection, as three kernels.

    proj       [B, L, P]       the fused input projection: qkv (C) | z (Hv*Dv) | b (Hv) | a (Hv)
    conv_state [B, K-1, C]     the conv tail before the chunk (proj's dtype T)
    ssm        [B, Hv, Dv, Dk] float32 recurrent state
    conv_w     [C, K]; a_log, dt_bias [Hv] (float32); norm_w [Dv]
    left_pad   [B] int32       each row's padding columns before its first real token, or None
    mask       [B, L] bool     True on real tokens (the same padding), or None
 -> y [B, L, Hv*Dv] (T, gated-normed: the input of out_proj), conv_state', ssm'

What it computes is `deltanet_decode_ops` (kernels/deltanet_decode.py) token after token,
a padded token leaving every state as it was and writing y = 0: the model's `deltanet_core`
(models/deltanet.py) over a left-padded chunk. Compiled, that core is still ~45 graph
nodes a layer (the conv's shifted views and gathers, splits, norms, gates, casts), and
on a GPU each node costs host time whatever its size: a mixed step's cost was mostly MLX
encoding them (bench/README.md has the figures). Here the core is three: the conv,
SiLU, L2 norms and gates of every token at once (`_PROLOGUE`, parallel over tokens: the
causal conv of token t reads its K-1 predecessors, or the conv state before a row's
first real token), the recurrence (kernels/gated_delta_scan.py), and the gated RMSNorm
(`_EPILOGUE`).

Backends (kernels/platform.py `fused_deltanet_chunk`, with `deltanet_scan`): CUDA -> the
kernels; elsewhere, or switched off -> `deltanet_chunk_ops`, the plain-MLX reference the
tests compare the kernels against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from deltaserve.kernels.deltanet_decode import (
    DecodeDims,
    check_inputs,
    deltanet_decode_ops,
    supported,
)
from deltaserve.kernels.gated_delta_scan import gated_delta_scan
from deltaserve.kernels.jit import kernel_name
from deltaserve.kernels.platform import current_platform
from deltaserve.kernels.rms_norm import float_bits

__all__ = ["deltanet_chunk", "deltanet_chunk_ops", "uses_kernels"]


def deltanet_chunk_ops(
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """The reference: one `deltanet_decode_ops` token per column; a masked column keeps
    each row's conv tail and state and yields zeros."""
    conv_state = conv_state.astype(proj.dtype)
    ys = []
    for t in range(proj.shape[1]):
        y, conv, state = deltanet_decode_ops(
            dims, proj[:, t], conv_state, ssm, conv_w, a_log, dt_bias, norm_w
        )
        if mask is not None:
            real = mask[:, t]
            y = mx.where(real[:, None], y, mx.zeros_like(y))
            conv = mx.where(real[:, None, None], conv, conv_state)
            state = mx.where(real[:, None, None, None], state, ssm)
        ys.append(y)
        conv_state, ssm = conv, state
    return mx.stack(ys, axis=1), conv_state, ssm


_CUDA_HEADER = """
namespace deltaserve_dnc {

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// Sum over the threads of one warp (every lane gets it).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

}  // namespace deltaserve_dnc
"""

# One block per (row, token, key head): 2 * Dk threads, the head's q channels then its k
# channels; then the v channels of the key head's Hv / Hk value heads, and their gates.
# Template: Dk, Dv, Hk, Hv, K; T (proj), Tw (conv_w), Ta (a_log), Tdt (dt_bias). __PAD__:
# the row's pad count (its left_pad input, or 0 in the variant without one).
_PROLOGUE = """
  using namespace deltaserve_dnc;
  constexpr int QK = Hk * Dk;
  constexpr int C = 2 * QK + Hv * Dv;
  constexpr int VD = Hv * Dv;
  constexpr int P = C + VD + 2 * Hv;
  constexpr int R = Hv / Hk;
  constexpr int NT = 2 * Dk;
  __shared__ float partial[NT / 32];

  const int L = length[0];
  const int tid = threadIdx.x;
  const int hk = blockIdx.x % Hk;
  const int t = (blockIdx.x / Hk) % L;
  const int b = blockIdx.x / (Hk * L);
  const int pad = __PAD__;
  const bool real = t >= pad;
  const T* pr = proj + size_t(b) * L * P;
  const T* cs = conv_state + size_t(b) * (K - 1) * C;

  // Element i of row b's conv input: zeros left of its padding, its conv state just
  // before its first real token, then its tokens (models/deltanet.py shifted_conv_input).
  auto input = [&](int i, int ch) -> float {
    if (i < pad) return 0.f;
    if (i < pad + K - 1) return static_cast<float>(cs[(i - pad) * C + ch]);
    return static_cast<float>(pr[size_t(i - (K - 1)) * P + ch]);
  };
  // Conv + SiLU of channel ch at token t, each product and partial sum rounded to T as
  // the reference rounds (kernels/deltanet_decode.py)
  auto conv = [&](int ch) -> float {
    T acc = static_cast<T>(input(t, ch) * static_cast<float>(static_cast<T>(conv_w[ch * K])));
#pragma unroll
    for (int j = 1; j < K; ++j) {
      const float w = static_cast<float>(static_cast<T>(conv_w[ch * K + j]));
      const T prod = static_cast<T>(input(t + j, ch) * w);
      acc = static_cast<T>(static_cast<float>(acc) + static_cast<float>(prod));
    }
    return static_cast<float>(static_cast<T>(silu(static_cast<float>(acc))));
  };
  // The new conv tail (the chunk's last K-1 inputs), written by the last token's blocks
  auto tail = [&](int ch) {
    if (t == L - 1) {
#pragma unroll
      for (int j = 0; j < K - 1; ++j) {
        tail_out[(size_t(b) * (K - 1) + j) * C + ch] = static_cast<T>(input(L + j, ch));
      }
    }
  };

  // q (threads [0, Dk)) or k ([Dk, 2 Dk)) channel: L2-normalised over the key head
  const bool is_q = tid < Dk;
  const int ch = is_q ? hk * Dk + tid : QK + hk * Dk + (tid - Dk);
  const float val = real ? conv(ch) : 0.f;
  const float sq = warp_sum(val * val);
  if ((tid & 31) == 0) partial[tid >> 5] = sq;
  tail(ch);
  __syncthreads();
  float total = 0.f;
  const int first = is_q ? 0 : Dk / 32;
#pragma unroll
  for (int w = 0; w < Dk / 32; ++w) total += partial[first + w];
  const size_t qk_at = ((size_t(b) * L + t) * Hk + hk) * Dk + (tid % Dk);
  const float normed = val * rsqrtf(total + 1e-6f);
  if (is_q) {
    q_out[qk_at] = real ? normed * rsqrtf(float(Dk)) : 0.f;
  } else {
    k_out[qk_at] = real ? normed : 0.f;
  }

  // v channels of the key head's value heads, and their gates
  for (int i = tid; i < R * Dv; i += NT) {
    const int vch = 2 * QK + hk * R * Dv + i;
    v_out[(size_t(b) * L + t) * VD + hk * R * Dv + i] = static_cast<T>(real ? conv(vch) : 0.f);
    tail(vch);
  }
  if (tid < R) {
    const int h = hk * R + tid;
    const size_t at = (size_t(b) * L + t) * Hv + h;
    const T* row = pr + size_t(t) * P;
    const float beta = 1.f / (1.f + expf(-static_cast<float>(row[C + VD + h])));
    const float ain = static_cast<float>(row[C + VD + Hv + h]) + static_cast<float>(dt_bias[h]);
    const float softplus = fmaxf(ain, 0.f) + log1pf(expf(-fabsf(ain)));
    beta_out[at] = real ? beta : 0.f;
    g_out[at] = real ? -expf(static_cast<float>(a_log[h])) * softplus : 0.f;
  }
"""

# One block per (row, token, value head), Dv threads: norm_w * rmsnorm(y) * silu(z).
# Template: Dk, Dv, Hk, Hv; T (y, proj), Tn (norm_w); EPS_BITS.
_EPILOGUE = """
  using namespace deltaserve_dnc;
  constexpr int C = 2 * Hk * Dk + Hv * Dv;
  constexpr int VD = Hv * Dv;
  constexpr int P = C + VD + 2 * Hv;
  __shared__ float partial[Dv / 32];

  const int d = threadIdx.x;
  const int n = blockIdx.x;  // (b * L + t) * Hv + h
  const int h = n % Hv;
  const size_t token = n / Hv;
  const float yv = static_cast<float>(y[size_t(n) * Dv + d]);
  const float sq = warp_sum(yv * yv);
  if ((d & 31) == 0) partial[d >> 5] = sq;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < Dv / 32; ++w) total += partial[w];
  const float eps = __int_as_float(EPS_BITS);
  const float normed = yv * rsqrtf(total / float(Dv) + eps);
  const float z = static_cast<float>(proj[token * P + C + h * Dv + d]);
  out[token * VD + h * Dv + d] = static_cast<T>(static_cast<float>(norm_w[d]) * normed * silu(z));
"""


@functools.cache
def _kernels() -> tuple[Callable[..., list[mx.array]], ...]:
    """The prologue (padded and not) and the epilogue, CUDA."""
    make = mx.fast.cuda_kernel
    inputs = ["proj", "conv_state", "conv_w", "a_log", "dt_bias", "length"]
    outputs = ["q_out", "k_out", "v_out", "g_out", "beta_out", "tail_out"]
    prologues = []
    for pad, extra in (("0", []), ("left_pad[b]", ["left_pad"])):
        source = _PROLOGUE.replace("__PAD__", pad)
        prologues.append(
            make(
                name=kernel_name("deltaserve_dn_chunk_prologue", source, _CUDA_HEADER),
                input_names=[*inputs, *extra],
                output_names=outputs,
                source=source,
                header=_CUDA_HEADER,
            )
        )
    epilogue = make(
        name=kernel_name("deltaserve_dn_chunk_epilogue", _EPILOGUE, _CUDA_HEADER),
        input_names=["y", "proj", "norm_w"],
        output_names=["out"],
        source=_EPILOGUE,
        header=_CUDA_HEADER,
    )
    return prologues[0], prologues[1], epilogue


def uses_kernels(dims: DecodeDims) -> bool:
    """Whether `deltanet_chunk` runs the kernels here: CUDA with both `fused_deltanet_chunk`
    and `deltanet_scan` on, at sizes they take (every Qwen3.5 shape): the decode kernel's
    (`supported`: Dk a multiple of 32, Hv of Hk, which the scan needs too) and Dv a
    multiple of 32 (the epilogue's warps)."""
    profile = current_platform()
    on = profile.fused_deltanet_chunk and profile.deltanet_scan and profile.device == "cuda"
    return on and supported(dims) and dims.head_v_dim % 32 == 0


def deltanet_chunk(
    dims: DecodeDims,
    proj: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
    left_pad: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """A chunk of L tokens of a DeltaNet layer (shapes in the module docstring): the
    kernels on CUDA (`uses_kernels`), `deltanet_chunk_ops` elsewhere. left_pad and mask
    describe the same padding (both or neither): the prologue places each row's conv
    state by its pad count, the scan skips the masked tokens."""
    check_inputs(dims, proj, conv_state, ssm, conv_w, a_log, dt_bias, norm_w)
    if (left_pad is None) != (mask is None):
        raise ValueError("left_pad and mask describe one padding: give both or neither")
    b, length = proj.shape[:2]
    conv_state = conv_state.astype(proj.dtype)
    if not uses_kernels(dims):
        return deltanet_chunk_ops(dims, proj, conv_state, ssm, conv_w, a_log, dt_bias, norm_w, mask)
    hk, dk, hv, dv = dims.num_k_heads, dims.head_k_dim, dims.num_v_heads, dims.head_v_dim
    plain, padded, epilogue = _kernels()
    template = [("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv), ("K", dims.kernel)]
    template += [("T", proj.dtype), ("Tw", conv_w.dtype), ("Ta", a_log.dtype)]
    template += [("Tdt", dt_bias.dtype)]
    inputs = [proj, conv_state, conv_w, a_log, dt_bias, mx.array([length], mx.int32)]
    kernel = plain if left_pad is None else padded
    if left_pad is not None:
        inputs.append(left_pad.astype(mx.int32))
    qk_shape = (b, length, hk, dk)
    q, k, v, g, beta, tail = kernel(
        inputs=inputs,
        template=template,
        grid=(b * length * hk * 2 * dk, 1, 1),
        threadgroup=(2 * dk, 1, 1),
        output_shapes=[qk_shape, qk_shape, (b, length, hv, dv), (b, length, hv),
                       (b, length, hv), conv_state.shape],
        output_dtypes=[mx.float32, mx.float32, proj.dtype, mx.float32, mx.float32,
                       proj.dtype],
    )  # fmt: skip
    y, ssm = gated_delta_scan(q, k, v, g, beta, ssm, mask)
    template = [("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv)]
    template += [("T", proj.dtype), ("Tn", norm_w.dtype)]
    template += [("EPS_BITS", float_bits(dims.norm_eps))]
    (out,) = epilogue(
        inputs=[y, proj, norm_w],
        template=template,
        grid=(b * length * hv * dv, 1, 1),
        threadgroup=(dv, 1, 1),
        output_shapes=[(b, length, hv * dv)],
        output_dtypes=[proj.dtype],
    )
    return out, tail, ssm
