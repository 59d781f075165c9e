"""Gated DeltaNet (linear attention) layer of Qwen3.5."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels import fastmath
from kernels.gated_delta import gated_delta
from models.config import TextConfig
from models.fused import fuse_into
from models.layers import GatedRMSNorm
from models.state import RecurrentState


def _l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def shifted_conv_input(
    conv_state: mx.array, x: mx.array, mask: mx.array | None, left_pad: tuple[int, ...] | None
) -> mx.array:
    """[B, K-1, C] state + [B, L, C] inputs -> [B, K-1+L, C] with each row's state adjacent
    to its first real token, so left padding never sits between a row's history and its
    new tokens (padding moves to the far left, as zeros)."""
    if mask is None:
        return mx.concatenate([conv_state, x], axis=1)
    x = mx.where(mask[..., None], x, mx.zeros_like(x))
    full = mx.concatenate([conv_state, x], axis=1)
    tail = conv_state.shape[1]
    pad = mx.array(left_pad, dtype=mx.int32)[:, None]  # [B, 1]
    j = mx.arange(full.shape[1], dtype=mx.int32)[None]  # [1, K-1+L]
    # positions j < pad + tail read the state (shifted right by pad); later ones are in place
    src = mx.where(j < pad + tail, mx.maximum(j - pad, 0), j)
    gathered = mx.take_along_axis(full, src[..., None], axis=1)
    return mx.where((j >= pad)[..., None], gathered, mx.zeros_like(gathered))


class GatedDeltaNet(nn.Module):
    """in_proj -> causal depthwise conv + SiLU -> L2-normed q/k -> gated delta rule ->
    gated RMSNorm -> out_proj. State: conv tail [B, K-1, C] and recurrent [B, Hv, Dv, Dk]."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = cfg.conv_dim
        hidden = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((self.conv_dim, self.kernel_size))  # [C, K]
        self.A_log = mx.zeros((self.num_v_heads,), dtype=mx.float32)
        self.dt_bias = mx.ones((self.num_v_heads,), dtype=mx.float32)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _project(self, x: mx.array) -> list[mx.array]:
        """qkv [B, L, conv_dim], z [B, L, value_dim], b and a [B, L, Hv]."""
        if "in_proj" in self:
            return self.in_proj(x)
        return [self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)]

    def fuse_projections(self) -> None:
        """After loading: the four input projections as one matmul (models/fused.py)."""
        fuse_into(self, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], "in_proj")

    def _conv(self, x: mx.array, state: RecurrentState, mask, left_pad) -> mx.array:
        """Causal depthwise conv over [state tail, x]; updates state.conv. x [B, L, C]."""
        b, length, c = x.shape
        tail = self.kernel_size - 1
        conv_state = state.conv if state.conv is not None else mx.zeros((b, tail, c), x.dtype)
        full = shifted_conv_input(conv_state.astype(x.dtype), x, mask, left_pad)
        state.conv = full[:, -tail:]
        w = self.conv1d.weight.astype(x.dtype)
        out = full[:, 0:length] * w[:, 0]
        for j in range(1, self.kernel_size):
            out = out + full[:, j : j + length] * w[:, j]
        return fastmath.silu(out)

    def __call__(
        self,
        x: mx.array,
        state: RecurrentState,
        mask: mx.array | None,
        left_pad: tuple[int, ...] | None,
    ) -> mx.array:
        """x [B, L, H] -> [B, L, H]; mask [B, L] (True = real) keeps pads out of the state."""
        b, length, _ = x.shape
        qkv, z, beta_in, a_in = self._project(x)
        qkv = self._conv(qkv, state, mask, left_pad)
        q = qkv[..., : self.key_dim].reshape(b, length, self.num_k_heads, self.head_k_dim)
        k = qkv[..., self.key_dim : 2 * self.key_dim].reshape(q.shape)
        v = qkv[..., 2 * self.key_dim :].reshape(b, length, self.num_v_heads, self.head_v_dim)
        q = _l2_normalize(q.astype(mx.float32)) * (self.head_k_dim**-0.5)
        k = _l2_normalize(k.astype(mx.float32))
        beta = fastmath.sigmoid(beta_in.astype(mx.float32))
        a = a_in.astype(mx.float32) + self.dt_bias
        g = -mx.exp(self.A_log) * mx.logaddexp(a, mx.zeros_like(a))  # log-decay <= 0
        ssm = state.ssm
        if ssm is None:
            ssm = mx.zeros((b, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        y, state.ssm = gated_delta(q, k, v, g, beta, ssm, mask)
        z = z.reshape(b, length, self.num_v_heads, self.head_v_dim)
        y = self.norm(y, z).reshape(b, length, self.value_dim)
        return self.out_proj(y)
