"""Gated full attention of Qwen3.5 (query + output gate interleaved per head in q_proj)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from deltaserve.kernels import fastmath
from deltaserve.models.config import TextConfig
from deltaserve.models.fused import fuse_into
from deltaserve.models.layers import MRoPE, RMSNorm, linear_plus
from deltaserve.models.state import AttentionState


class GatedAttention(nn.Module):
    """q/k RMSNorm before partial mRoPE; output scaled by sigmoid(gate) before o_proj."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        hidden, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * hd * 2, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, hidden, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project(self, x: mx.array) -> list[mx.array]:
        """[query | gate] [B, L, Hq * 2 * hd], keys and values [B, L, Hkv * hd]."""
        if "qkv_proj" in self:
            return self.qkv_proj(x)
        return [self.q_proj(x), self.k_proj(x), self.v_proj(x)]

    def fuse_projections(self) -> None:
        """After loading: q, k and v projections as one matmul (models/fused.py)."""
        fuse_into(self, ["q_proj", "k_proj", "v_proj"], "qkv_proj")

    def __call__(
        self,
        x: mx.array,
        rope: MRoPE,
        cos_sin: tuple[mx.array, mx.array],
        state: AttentionState,
        left_pad: tuple[int, ...] | None,
        last_only: bool = False,
        residual: mx.array | None = None,
    ) -> mx.array:
        """x [B, L, H] -> [B, L, H] ([B, 1, H] with last_only, see `core`), plus `residual`
        when given (`linear_plus`); appends this step's K/V to `state`."""
        core = self.core(self.project(x), rope, cos_sin, state, left_pad, last_only)
        return linear_plus(self.o_proj, core, residual)

    def core(
        self,
        projected: list[mx.array],
        rope: MRoPE,
        cos_sin: tuple[mx.array, mx.array],
        state: AttentionState,
        left_pad: tuple[int, ...] | None,
        last_only: bool = False,
    ) -> mx.array:
        """`project`'s outputs [B, L, *] -> o_proj's input [B, L, Hq * hd]; with last_only
        every position's K/V is stored but only the last query attends: [B, 1, Hq * hd]."""
        q_and_gate, keys, values = projected
        b, length, _ = q_and_gate.shape
        hd = self.head_dim
        # q_proj emits [query | gate] per head: [B, L, Hq, 2 * hd]
        q_and_gate = q_and_gate.reshape(b, length, self.num_heads, 2 * hd)
        queries, gate = q_and_gate[..., :hd], q_and_gate[..., hd:]
        keys = keys.reshape(b, length, self.num_kv_heads, hd)
        values = values.reshape(b, length, self.num_kv_heads, hd)
        # -> [B, heads, L, hd]
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(keys).transpose(0, 2, 1, 3)
        values = values.transpose(0, 2, 1, 3)
        cos, sin = cos_sin
        queries = rope.apply(queries, cos, sin)
        keys = rope.apply(keys, cos, sin)
        if last_only:
            queries, gate, length = queries[:, :, -1:], gate[:, -1:], 1
        out = state.attend(queries, keys, values, self.scale, left_pad)
        out = out.transpose(0, 2, 1, 3).reshape(b, length, self.num_heads * hd)
        return out * fastmath.sigmoid(gate.reshape(b, length, -1))

    @property
    def output(self) -> nn.Module:
        """The output projection (o_proj), named alike in both mixers."""
        return self.o_proj
