"""Qwen3.5's multi-token prediction (MTP) head: the draft source of speculative decoding.

Every Qwen3.5 checkpoint ships one (`mtp.*`, config `mtp_num_hidden_layers: 1`). For the
trunk's final-normed hidden h_t at position t (the tensor its lm_head scores) and the
token x_{t+1} that followed it:

    u = fc([pre_fc_norm_embedding(embed(x_{t+1})) ; pre_fc_norm_hidden(h_t)])  # embedding first
    u = decoder layer (gated full attention with its own KV, the trunk's MLP or MoE)
    m = norm(u)          -> logits through the trunk's lm_head: a guess at x_{t+2}

The pair (h_t, x_{t+1}) sits at rotary position t. The embedding and the LM head are the
trunk's (shared). Drafting k tokens chains the head: its own m and its draft form the next
pair, at position t + 1 (vLLM's qwen3_next_mtp and its EAGLE proposer; mlx-vlm's drafter;
../reference §3). The post-norm trunk hidden is the input every peer measured best.

The head's KV store (one column per pair) is the caller's, like the trunk's: rows are
left-padded and batched the same way (engine/cache/kv.py), so the head takes the same
AttentionState objects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from deltaserve.models.config import TextConfig
from deltaserve.models.layers import MRoPE, RMSNorm, SparseMoE
from deltaserve.models.qwen35 import DecoderLayer, Qwen35Model
from deltaserve.models.state import AttentionState

logger = logging.getLogger(__name__)

# Picks one token per row from logits [B, V] (float32) -> [B] int32
Chooser = Callable[[mx.array], mx.array]


def greedy(logits: mx.array) -> mx.array:
    """The argmax token of each row: [B, V] -> [B] int32."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


class MTPHead(nn.Module):
    """fc, the three zero-centred norms (gains folded by the loader) and one decoder layer;
    HF names below `mtp.` (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm`,
    `layers.0.*`), so the loader's `mtp_weights` load as they are."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps)
        self.layers = [DecoderLayer(cfg, 0, full_attention=True)]
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self._rope = MRoPE(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)

    def __call__(
        self,
        embeds: mx.array,
        hidden: mx.array,
        positions: mx.array,
        state: AttentionState,
        left_pad: tuple[int, ...] | None = None,
        last_only: bool = False,
    ) -> mx.array:
        """One head pass over L pairs per row: embeds (of x_{t+1}) and hidden (h_t) [B, L, H],
        positions [3, B, L] (t), left_pad as ForwardGroup's. Appends the L pairs' K/V to
        `state`; returns the normed output m [B, L, H] ([B, 1, H] with last_only: only the
        last pair's output is computed past the attention's K/V)."""
        x = self.fc(
            mx.concatenate(
                [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1
            )
        )
        layer = self.layers[0]
        cos_sin = self._rope.cos_sin(positions)
        attn = layer.self_attn(
            layer.input_layernorm(x), self._rope, cos_sin, state, left_pad, last_only
        )
        x = (x[:, -1:] if last_only else x) + attn
        return self.norm(layer.feed_forward(x))

    def fuse_projections(self) -> None:
        """After loading: each projection group as one matmul, as the trunk's layers."""
        layer = self.layers[0]
        layer.self_attn.fuse_projections()
        mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
        mlp.fuse_projections()


@dataclass(frozen=True)
class Drafts:
    """What one drafting round gives each row."""

    tokens: mx.array  # [B, k] int32 draft tokens, in order
    logits: mx.array  # [B, k, V] float32: the head's logits for each draft (speculative
    # sampling's draft distribution q comes from them under the row's sampling params)


def draft(
    model: Qwen35Model,
    head: MTPHead,
    hidden: mx.array,
    tokens: mx.array,
    positions: mx.array,
    state: AttentionState,
    num_draft: int,
    left_pad: tuple[int, ...] | None = None,
    choose: Chooser = greedy,
) -> Drafts:
    """Draft `num_draft` tokens per row with the MTP head.

    hidden [B, L, H]: the trunk's final-normed hidden at the row's positions not yet
    paired in the head's KV (after a prefill: the prompt's; after a verify that kept
    a + 1 columns: those a + 1), right-aligned with left_pad[b] padding columns;
    tokens [B, L]: the token that followed each (the last one is the token just sampled);
    positions [3, B, L]: the hidden's positions. The first pass appends the L true pairs
    to `state`; each further draft appends one speculative pair (its hidden is the
    head's, not the trunk's), so the caller drops the newest num_draft - 1 columns of
    every row (KVStore.rollback) before the next round appends the verified pairs.
    choose: logits [B, V] -> tokens [B] (greedy, or sampling under the rows' params).
    """
    assert num_draft >= 1, "draft at least one token"
    embed = model.embed_tokens
    m = head(embed(tokens), hidden, positions, state, left_pad, last_only=True)
    logits = model.logits(m[:, 0])
    out_tokens, out_logits = [choose(logits)], [logits]
    last = positions[:, :, -1:]
    for step in range(1, num_draft):
        step_embeds = embed(out_tokens[-1][:, None])
        m = head(step_embeds, m, last + step, state)
        logits = model.logits(m[:, 0])
        out_tokens.append(choose(logits))
        out_logits.append(logits)
    return Drafts(mx.stack(out_tokens, axis=1), mx.stack(out_logits, axis=1))


def log_missing_head(path: object) -> None:
    """The one line saying a checkpoint cannot draft (speculation then stays off)."""
    logger.info("%s has no MTP head (mtp.* weights): multi-token prediction unavailable", path)
