"""Metal source of kernels/deltanet_decode.py's kernel: the same algorithm as its CUDA
source, with threadgroups of LANES * Dv threads, one per (row, value head), and the state
read as plain floats. Never run here (no Mac); kept beside the CUDA source behind the same
function (`deltanet_decode`), which picks it on Metal when the platform profile has
`fused_deltanet_decode` on (kernels/platform.py)."""

from __future__ import annotations

METAL_HEADER = """
// Sum over the LANES consecutive lanes that share one state row.
template <int LANES>
inline float row_sum(float x) {
  for (ushort o = LANES / 2; o > 0; o /= 2) {
    x += simd_shuffle_xor(x, o);
  }
  return x;
}

// Sum of x over the threadgroup (every thread gets it); scratch holds NW floats.
template <int NW>
inline float block_sum(float x, threadgroup float* scratch, uint tid) {
  x = simd_sum(x);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if ((tid & 31) == 0) {
    scratch[tid >> 5] = x;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (int i = 0; i < NW; ++i) {
    total += scratch[i];
  }
  return total;
}

inline float dn_silu(float x) { return x / (1.0f + metal::exp(-x)); }
"""


def conv_stage(silu: str, unroll: str) -> str:
    """Stage 1 of the kernel, the same text in both sources: each thread's conv channel
    (q, k or v of its head), conv + SiLU rounded as the reference rounds, q/k squares for
    the L2 norms, and the new conv tail. `silu`: the source's SiLU function; `unroll`:
    its loop-unroll pragma line (empty: none)."""
    return CONV_CHANNEL + _CONV_STAGE.replace("@SILU@", silu).replace("@UNROLL@", unroll)


# The start of stage 1: the thread's conv channel `ch` (q, k or v of its head; -1: none)
# and whether it writes that channel's conv tail (`write_tail`); the many-column CUDA
# kernel's too
CONV_CHANNEL = """\
  int ch = -1;
  bool write_tail = true;
  if (tid < Dk) {
    ch = hk * Dk + tid;
    write_tail = (h % (Hv / Hk)) == 0;
  } else if (tid < 2 * Dk) {
    ch = QK + hk * Dk + (tid - Dk);
    write_tail = (h % (Hv / Hk)) == 0;
  } else if (tid < 2 * Dk + Dv) {
    ch = 2 * QK + h * Dv + (tid - 2 * Dk);
  }
"""

# The channel's conv output `val` into q, k or v (shared memory) and its square into the
# q/k L2 norm's partial sum (the conv stage's, and the many-column CUDA kernel's)
CONV_STORE = """\
    if (tid < Dk) {
      qf[tid] = val;
      x2q = val * val;
    } else if (tid < 2 * Dk) {
      kf[tid - Dk] = val;
      x2k = val * val;
    } else {
      vs[tid - 2 * Dk] = val;
    }
"""

_CONV_STAGE = (
    """\
  float x2q = 0.f, x2k = 0.f;
  if (ch >= 0) {
    // as the reference: each product and partial sum rounded to T
    const float w0 = static_cast<float>(static_cast<T>(conv_w[ch * K]));
    T acc = static_cast<T>(static_cast<float>(cs[ch]) * w0);
@UNROLL@    for (int j = 1; j < K; ++j) {
      const float x = j < K - 1 ? static_cast<float>(cs[j * C + ch]) : static_cast<float>(pr[ch]);
      const T prod = static_cast<T>(x * static_cast<float>(static_cast<T>(conv_w[ch * K + j])));
      acc = static_cast<T>(static_cast<float>(acc) + static_cast<float>(prod));
    }
    const float val = static_cast<float>(static_cast<T>(@SILU@(static_cast<float>(acc))));
"""
    + CONV_STORE
    + """\
    if (write_tail) {
@UNROLL@      for (int j = 0; j < K - 2; ++j) {
        co[j * C + ch] = cs[(j + 1) * C + ch];
      }
      co[(K - 2) * C + ch] = pr[ch];
    }
  }
"""
)


# Same algorithm as deltanet_decode._CUDA_SOURCE (untested here: no Metal device); threadgroups of
# LANES * Dv threads, one per (row, value head); the state is read as plain floats.
METAL_SOURCE = (
    """
  constexpr int BLOCK = LANES * Dv;
  constexpr int NW = BLOCK / 32;
  constexpr int NPL = Dk / LANES;
  constexpr int QK = Hk * Dk;
  constexpr int C = 2 * QK + Hv * Dv;
  constexpr int VD = Hv * Dv;
  constexpr int P = C + VD + 2 * Hv;
  threadgroup float qf[Dk];
  threadgroup float kf[Dk];
  threadgroup float vs[Dv];
  threadgroup float scratch[NW];

  const uint tid = thread_position_in_threadgroup.x;
  const uint n = threadgroup_position_in_grid.x;
  const uint b = n / Hv;
  const uint h = n % Hv;
  const uint hk = h / (Hv / Hk);
  const device T* pr = proj + b * P;
  const device T* cs = conv_state + b * (K - 1) * C;
  device T* co = conv_out + b * (K - 1) * C;

"""
    + conv_stage("dn_silu", "")
    + """
  const float q_sum = block_sum<NW>(x2q, scratch, tid);
  const float q_scale = metal::rsqrt(q_sum + 1e-6f) * metal::rsqrt(float(Dk));
  const float k_scale = metal::rsqrt(block_sum<NW>(x2k, scratch, tid) + 1e-6f);
  if (tid < Dk) {
    qf[tid] *= q_scale;
  } else if (tid < 2 * Dk) {
    kf[tid - Dk] *= k_scale;
  }
  const float beta = 1.0f / (1.0f + metal::exp(-static_cast<float>(pr[C + VD + h])));
  const float ain = static_cast<float>(pr[C + VD + Hv + h]) + dt_bias[h];
  const float softplus = metal::max(ain, 0.0f) + metal::log(1.0f + metal::exp(-metal::abs(ain)));
  const float a = metal::exp(-metal::exp(a_log[h]) * softplus);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint lane = tid % LANES;
  const uint row = tid / LANES;
  const device float* src = ssm + (n * Dv + row) * Dk;
  device float* dst = ssm_out + (n * Dv + row) * Dk;
  float s[NPL];
  float sk = 0.0f, sq = 0.0f, kq = 0.0f;
  for (int i = 0; i < NPL; ++i) {
    const uint c = lane + i * LANES;
    s[i] = src[c];
    sk += s[i] * kf[c];
    sq += s[i] * qf[c];
    kq += kf[c] * qf[c];
  }
  sk = row_sum<LANES>(sk);
  sq = row_sum<LANES>(sq);
  kq = row_sum<LANES>(kq);
  const float delta = beta * (vs[row] - a * sk);
  for (int i = 0; i < NPL; ++i) {
    const uint c = lane + i * LANES;
    dst[c] = a * s[i] + delta * kf[c];
  }
  const float yr = static_cast<float>(static_cast<T>(a * sq + delta * kq));

  const float ss = block_sum<NW>(lane == 0 ? yr * yr : 0.0f, scratch, tid);
  if (lane == 0) {
    const float eps = as_type<float>(EPS_BITS);
    const float normed = yr * metal::rsqrt(ss / float(Dv) + eps);
    const float z = static_cast<float>(pr[C + h * Dv + row]);
    const float out = static_cast<float>(norm_w[row]) * normed * dn_silu(z);
    y[b * VD + h * Dv + row] = static_cast<T>(out);
  }
"""
)
