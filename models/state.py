"""What the model needs from per-layer row state, and what one forward group is.

The model never owns caches: the engine passes, per group and per layer, an object that
implements one of the two protocols below. Storage, padding bookkeeping and the row ops
(merge / filter / extract) live in engine/cache; the model only reads and writes through
these calls, so plain, affine-quantized and TurboQuant KV stores plug in unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import mlx.core as mx


class AttentionState(Protocol):
    """KV store of one full-attention layer for the rows of one group."""

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        left_pad: tuple[int, ...] | None,
    ) -> mx.array:
        """Append this step's keys/values and attend over everything stored.

        queries [B, Hq, Lq, D] (rotary applied) for the last Lq <= L of the new tokens,
        keys/values [B, Hkv, L, D]; the new tokens are right-aligned with `left_pad[b]`
        padding tokens on the left of row b (None: no padding). Returns [B, Hq, Lq, D]:
        causal attention that never looks at padding.
        """
        ...


class RecurrentState(Protocol):
    """Gated-DeltaNet state of one linear-attention layer for the rows of one group.

    conv: [B, K-1, conv_dim], the last K-1 *pre-conv* inputs of each row (None = zeros).
    ssm:  [B, Hv, Dv, Dk] float32 recurrent state (None = zeros).
    The model reads both before the layer runs and writes both after.
    checkpoint: (conv, ssm) as they were after the first ForwardGroup.snapshot_at columns,
    written by a forward that has them (a prefix-cache snapshot inside a chunk).
    slots: (conv [B, L, K-1, conv_dim], ssm [B, L, Hv, Dv, Dk]) after EACH of the L
    columns, written by a forward with ForwardGroup.state_slots (a speculative verify:
    a row that accepts a drafts keeps slot a, with no replay forward).
    """

    conv: mx.array | None
    ssm: mx.array | None
    checkpoint: tuple[mx.array, mx.array] | None
    slots: tuple[mx.array, mx.array] | None


LayerState = AttentionState | RecurrentState


Outputs = Literal["all", "last", "none"]  # ForwardGroup.outputs


@dataclass
class ForwardGroup:
    """Rows that share one batched state and one input shape [B, L].

    Written by the engine's runner; read by the model.
    """

    # [B, L] int32 token ids (ignored when `embeds` is given)
    tokens: mx.array | None
    # [3, B, L] int32 (T, H, W) rotary positions of every input token; text rows T = H = W
    positions: mx.array
    # One state per decoder layer (AttentionState for full-attention layers, else
    # RecurrentState), each holding exactly this group's B rows.
    states: list
    # Per-row count of padding tokens at the left of this step's input (None = none); a
    # [B] int32 array inside a compiled forward (engine/compiled_prefill.py), where the
    # counts are data, not constants of the trace.
    left_pad: tuple[int, ...] | mx.array | None = None
    # [B, L, H] input embeddings (vision prompts); overrides `tokens`
    embeds: mx.array | None = None
    # B = 1, unpadded: DeltaNet layers also keep their state after this many columns
    # (RecurrentState.checkpoint), running the core in two parts; 0 = none
    snapshot_at: int = 0
    # Which of the group's output the caller reads: "all" positions, each row's "last"
    # (a prompt chunk that samples), or "none" (one that samples nothing: only its states
    # are read). Below "all", the last layer computes only what is read: its attention
    # for the last query, or only its state, and outside any packing (packed with rows
    # that need their output, the chunk's last attention and MLP would run for them).
    outputs: Outputs = "all"
    # Unpadded rows (a speculative verify chunk: each row's last token + its k drafts):
    # DeltaNet layers also keep their state after every column (RecurrentState.slots)
    state_slots: bool = False

    def __post_init__(self) -> None:
        if self.outputs not in get_args(Outputs):
            raise ValueError(f"outputs must be one of {get_args(Outputs)}, got {self.outputs!r}")
        if self.state_slots and (self.snapshot_at or (self.left_pad and any(self.left_pad))):
            raise ValueError("state_slots needs an unpadded group without snapshot_at")

    @property
    def shape(self) -> tuple[int, int]:
        source = self.tokens if self.embeds is None else self.embeds
        return int(source.shape[0]), int(source.shape[1])

    def token_mask(self) -> mx.array | None:
        """[B, L] bool, True on real tokens; None when the group has no padding."""
        if self.left_pad is None:
            return None
        if not isinstance(self.left_pad, mx.array) and not any(self.left_pad):
            return None
        _, length = self.shape
        pad = mx.array(self.left_pad, dtype=mx.int32)[:, None]
        return mx.arange(length, dtype=mx.int32)[None, :] >= pad


def text_positions(offsets: list[int], length: int) -> mx.array:
    """[3, B, L] positions for text rows: row b covers offsets[b] .. offsets[b] + L - 1."""
    base = mx.array(offsets, dtype=mx.int32)[:, None] + mx.arange(length, dtype=mx.int32)[None]
    return mx.broadcast_to(base[None], (3, len(offsets), length))
