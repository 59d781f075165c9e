"""Qwen3.5 language model (dense and MoE) with a mixed-group forward.

One call runs several groups of rows (e.g. the decode batch [B, 1] and prefill chunks
[1, C]) through every layer: attention / DeltaNet per group (their states are disjoint).
With `pack_token_wise` on, the token-wise work around them (norms, the mixers' input and
output projections, the MLP/MoE) runs once over all groups' tokens: each weight is read
once per step, not once per group. On the CPU a matmul of a few rows costs its weight
bytes, so a small prompt group next to the decode rows cost a second pass over the
weights (0.8B, float32: ~0.3 s on a ~0.55 s step).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from deltaserve.models.attention import GatedAttention
from deltaserve.models.config import TextConfig
from deltaserve.models.deltanet import GatedDeltaNet
from deltaserve.models.layers import MLP, MRoPE, RMSNorm, SparseMoE, linear_plus
from deltaserve.models.parallel import TensorParallel
from deltaserve.models.state import ForwardGroup, LayerState


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + mixer(norm(x)); out = h + mlp(norm(h)).

    Tensor-parallel (`parallel` set): mixer and MLP hold this rank's heads / intermediate
    slice, so their outputs are partial sums, all-reduced before each residual add."""

    def __init__(
        self,
        cfg: TextConfig,
        layer_idx: int,
        parallel: TensorParallel | None = None,
        full_attention: bool | None = None,
    ) -> None:
        """full_attention: the mixer kind, when not the layer pattern's (the MTP head's
        layer is full attention whatever its index)."""
        super().__init__()
        self.parallel = parallel
        if full_attention is None:
            full_attention = cfg.is_full_attention(layer_idx)
        self.is_full_attention = full_attention
        if self.is_full_attention:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe:
            self.mlp = SparseMoE(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.shared_expert_intermediate_size,
                cfg.norm_topk_prob,
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def mix(
        self, x: mx.array, group: ForwardGroup, ctx: GroupContext, state, last_only: bool = False
    ) -> mx.array:
        """Residual + attention or DeltaNet for one group. x [B, L, H] -> [B, L, H], or
        [B, 1, H] with last_only (the last positions alone are read; every position's state
        is still written)."""
        h = self.input_layernorm(x)
        if self.parallel is not None:  # partial sums: all-reduced before the residual add
            out = self._mixer(h, group, ctx, state, last_only, None)
            return (x[:, -1:] if last_only else x) + self._reduce(out)
        return self._mixer(h, group, ctx, state, last_only, x)

    def _mixer(
        self,
        h: mx.array,
        group: ForwardGroup,
        ctx: GroupContext,
        state: LayerState,
        last_only: bool,
        residual: mx.array | None,
    ) -> mx.array:
        """The mixer over normed h, plus `residual` (x) when given, inside the output
        projection (models/layers.py linear_plus)."""
        if self.is_full_attention:
            if residual is not None and last_only:
                residual = residual[:, -1:]
            return self.self_attn(
                h, ctx.rope, ctx.cos_sin, state, group.left_pad, last_only, residual
            )
        out = self.linear_attn(
            h, state, ctx.mask, group.left_pad, group.snapshot_at, group.state_slots, residual
        )
        return out[:, -1:] if last_only else out

    def mix_many(
        self, xs: list[mx.array], groups: list[ForwardGroup], states: list
    ) -> list[mx.array]:
        """`mix` for several prefill groups of a DeltaNet layer in one call (prefill_many)."""
        normed = [self.input_layernorm(x) for x in xs]
        pads = [g.left_pad for g in groups]
        if self.parallel is None:  # the residual inside the output projection
            return self.linear_attn.prefill_many(normed, states, pads, xs)
        outs = self.linear_attn.prefill_many(normed, states, pads)
        return [x + self._reduce(out) for x, out in zip(xs, outs, strict=True)]

    def mix_packed(
        self,
        xs: list[mx.array],
        groups: list[ForwardGroup],
        contexts: list,
        states: list,
        last_only: Sequence[bool] = (),
    ) -> list[mx.array]:
        """`mix` for several groups, the norm and projections over all their tokens at
        once (each weight read once for all of them), only the core per group.
        last_only[i]: group i's output is its last position alone ([B, 1, H], as `mix`
        with last_only: a prompt that samples, in the last layer)."""
        mixer = self.self_attn if self.is_full_attention else self.linear_attn
        last_only = list(last_only) or [False] * len(xs)
        sizes = [x.shape[0] * x.shape[1] for x in xs]
        flat = mx.concatenate([x.reshape(n, -1) for x, n in zip(xs, sizes, strict=True)])
        normed = self.input_layernorm(flat)
        if self.is_full_attention:
            projected = mixer.project(normed)  # each [N, *]
        else:
            projected = [mixer.project_whole(normed)]  # [N, P]: each group's kernels' input
        cores, kept, start = [], [], 0
        groups_etc = zip(xs, groups, contexts, states, sizes, last_only, strict=True)
        for x, g, ctx, state, n, last in groups_etc:
            parts = [p[start : start + n].reshape(*x.shape[:2], -1) for p in projected]
            start += n
            if self.is_full_attention:
                y = mixer.core(parts, ctx.rope, ctx.cos_sin, state, g.left_pad, last)
            else:
                y = mixer.mix_whole(
                    parts[0], state, ctx.mask, g.left_pad, g.snapshot_at, g.state_slots
                )
                y = y[:, -1:] if last else y
            cores.append(y.reshape(-1, y.shape[-1]))
            kept.append(x[:, -1:] if last else x)  # each group's residual
        core = mx.concatenate(cores)
        out_sizes = [x.shape[0] * x.shape[1] for x in kept]
        if any(last_only):
            flat = mx.concatenate([x.reshape(n, -1) for x, n in zip(kept, out_sizes, strict=True)])
        if self.parallel is None:  # the residual inside the output projection
            out = linear_plus(mixer.output, core, flat)
            return [o.reshape(x.shape) for x, o in zip(kept, _split(out, out_sizes), strict=True)]
        out = self._reduce(mixer.output(core))
        return [x + o.reshape(x.shape) for x, o in zip(kept, _split(out, out_sizes), strict=True)]

    def packable(self, group: ForwardGroup, ctx: GroupContext) -> bool:
        """Whether the group's mixer input may be packed with others' (mix_packed)."""
        if self.is_full_attention:
            return True
        return self.linear_attn.packable(
            group.shape[1], ctx.mask, group.snapshot_at, group.state_slots
        )

    def feed_forward(self, x: mx.array) -> mx.array:
        """Residual + MLP over tokens x [N, H] (any leading shape is flattened). A dense
        MLP on one device takes the residual into its down projection (MLP.__call__);
        partial sums (tensor parallel) are all-reduced before the add."""
        flat = x.reshape(-1, x.shape[-1])
        normed = self.post_attention_layernorm(flat)
        if self.parallel is None and isinstance(self.mlp, MLP):
            return self.mlp(normed, residual=flat).reshape(x.shape)
        return x + self._reduce(self.mlp(normed)).reshape(x.shape)

    def feed_forward_packed(self, hidden: list[mx.array]) -> list[mx.array]:
        """`feed_forward` for several groups' tokens [B, L, H] as one: one matmul per
        weight over all of them instead of one per group."""
        sizes = [h.shape[0] * h.shape[1] for h in hidden]
        flat = mx.concatenate([h.reshape(-1, h.shape[-1]) for h in hidden], axis=0)
        flat = self.feed_forward(flat)
        return [p.reshape(h.shape) for p, h in zip(_split(flat, sizes), hidden, strict=True)]

    def _reduce(self, partial: mx.array) -> mx.array:
        return partial if self.parallel is None else self.parallel.all_sum(partial)


class GroupContext:
    """Per-group values computed once per forward and shared by every layer: the rotary
    cos / sin of its positions and its token mask (None: no padding)."""

    def __init__(
        self, rope: MRoPE, cos_sin: tuple[mx.array, mx.array], mask: mx.array | None
    ) -> None:
        self.rope = rope
        self.cos_sin = cos_sin
        self.mask = mask

    @classmethod
    def of(cls, group: ForwardGroup, rope: MRoPE) -> GroupContext:
        return cls(rope, rope.cos_sin(group.positions), group.token_mask())


class Qwen35Model(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; HF parameter names.

    parallel: this rank's place in a tensor-parallel group; `cfg` then has the per-rank
    sizes (models/parallel.shard_config) and the LM head holds this rank's vocabulary
    rows (always an own `lm_head`, tied checkpoints too)."""

    def __init__(self, cfg: TextConfig, parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i, parallel) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if parallel is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // parallel.size, bias=False)
        elif not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope = MRoPE(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
        self.pack_token_wise = False  # the engine sets it from EngineConfig

    def __call__(self, groups: list[ForwardGroup]) -> list[mx.array | None]:
        """Run every group through the stack; returns the final-normed hidden [B, L, H] of
        each group ([B, 1, H] for outputs "last", None for "none": ForwardGroup.outputs).
        Reads and writes each group's per-layer states in place."""
        hidden = [self._embed(g) for g in groups]
        contexts = [GroupContext.of(g, self._rope) for g in groups]
        *body, last = self.layers
        for idx, layer in enumerate(body):
            hidden = self._mix(layer, idx, hidden, groups, contexts)
            hidden = self._feed_forward(layer, hidden)
        idx, result = len(body), [None] * len(groups)
        for i, g in enumerate(groups):
            if g.outputs == "none":
                # Its own state is all the last layer owes the group: a mix run alone
                # whose output is never evaluated (MLX is lazy) runs no attention core
                # and no MLP (CPU: 4 ms of a 64-token chunk next to 8 decode rows).
                last.mix(hidden[i], g, contexts[i], g.states[idx])
            elif g.outputs == "last":
                h = last.mix(hidden[i], g, contexts[i], g.states[idx], last_only=True)
                result[i] = self.norm(last.feed_forward(h))
        live = [i for i, g in enumerate(groups) if g.outputs == "all"]
        out = self._mix(
            last, idx, [hidden[i] for i in live], [groups[i] for i in live],
            [contexts[i] for i in live],
        )  # fmt: skip
        for i, h in zip(live, self._feed_forward(last, out), strict=True):
            result[i] = self.norm(h)
        return result

    def _mix(
        self,
        layer: DecoderLayer,
        idx: int,
        hidden: list[mx.array],
        groups: list[ForwardGroup],
        contexts: list[GroupContext],
    ) -> list[mx.array]:
        """Attention / DeltaNet per group. With pack_token_wise, the groups whose mixer
        runs from its own projection (DecoderLayer.packable) share one norm and matmul
        per projection; with the compiled DeltaNet prefill on, the other prefill groups
        (L > 1) of a DeltaNet layer run as one call: on the GPU a layer's cost is its op
        count, which would otherwise grow with the number of cohorts."""
        done: dict[int, mx.array] = {}
        if self.pack_token_wise:
            packed = [i for i, g in enumerate(groups) if layer.packable(g, contexts[i])]
            if len(packed) > 1:
                merged = layer.mix_packed(
                    [hidden[i] for i in packed], [groups[i] for i in packed],
                    [contexts[i] for i in packed], [groups[i].states[idx] for i in packed],
                )  # fmt: skip
                done.update(zip(packed, merged, strict=True))
        if not layer.is_full_attention and layer.linear_attn.use_compiled(2):
            many = [
                i
                for i, g in enumerate(groups)
                if i not in done and g.shape[1] > 1 and not g.snapshot_at and not g.state_slots
            ]
            if len(many) > 1:
                states = [groups[i].states[idx] for i in many]
                merged = layer.mix_many(
                    [hidden[i] for i in many], [groups[i] for i in many], states
                )
                done.update(zip(many, merged, strict=True))
        return [
            done[i] if i in done else layer.mix(h, g, ctx, g.states[idx])
            for i, (h, g, ctx) in enumerate(zip(hidden, groups, contexts, strict=True))
        ]

    def _embed(self, group: ForwardGroup) -> mx.array:
        if group.embeds is not None:
            return group.embeds
        return self.embed_tokens(group.tokens)

    def _feed_forward(self, layer: DecoderLayer, hidden: list[mx.array]) -> list[mx.array]:
        if not self.pack_token_wise or len(hidden) < 2:
            return [layer.feed_forward(h) for h in hidden]
        return layer.feed_forward_packed(hidden)

    def fuse_projections(self) -> None:
        """After loading: each layer's projections of one input as one matmul (fewer
        kernel launches per step; see models/fused.py). HF names are gone afterwards."""
        for layer in self.layers:
            mixer = layer.self_attn if layer.is_full_attention else layer.linear_attn
            mixer.fuse_projections()
            mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
            mlp.fuse_projections()

    def logits(self, hidden: mx.array) -> mx.array:
        """Final-normed hidden [..., H] -> logits [..., V] (float32)."""
        if self.parallel is not None:
            out = self.parallel.gather_last(self.lm_head(hidden))  # [..., V/N] per rank
        elif self.config.tie_word_embeddings:
            out = self.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(mx.float32)


def _split(flat: mx.array, sizes: list[int]) -> list[mx.array]:
    """[sum(sizes), X] -> one [n, X] part per size, in order."""
    bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    return mx.split(flat, bounds, axis=0)
