"""Tensor parallelism: which slice of the model each process of an mx.distributed group holds.

Megatron-style splits, one all-reduce after each mixer and each MLP:

- full attention: query (+ gate), key and value heads split by rank; o_proj's input
  columns split, so each rank's o_proj gives a partial sum of the output;
- Gated DeltaNet: key and value heads (q, k, v, z, b, a projections, the conv channels of
  q / k / v, A_log, dt_bias, hence the conv and recurrent state) split by rank; out_proj's
  input columns split;
- MLP and the MoE's shared expert: intermediate dimension split (gate / up rows, down
  columns); routed experts: every expert's intermediate dimension split (each rank runs
  all experts on 1/N of their width; the router and the shared-expert gate are whole);
- LM head: vocabulary rows split, logits all-gathered (tied checkpoints get an untied
  head slice); embeddings, norms and the vision tower are whole on every rank.

Contiguous head splits keep grouped heads together: a query head h reads KV head
h // (Hq / Hkv) and a DeltaNet value head reads key head h // (Hv / Hk), so rank r's
value heads read exactly rank r's key heads. Everything else about the model is unchanged:
`shard_config` gives the per-rank sizes the modules are built with, and `shard_weights`
cuts each checkpoint tensor (quantized ones in their packed form) before it is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from deltaserve.models.config import TextConfig


class ShardError(ValueError):
    """The checkpoint's shapes do not split evenly over the group."""


class TensorParallel:
    """This process's rank in a tensor-parallel group and the collectives the forward uses."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def all_sum(self, x: mx.array) -> mx.array:
        """Sum of every rank's partial x (same shape on every rank)."""
        return mx.distributed.all_sum(x, group=self.group)

    def gather_last(self, x: mx.array) -> mx.array:
        """[..., V/N] slices, rank order -> [..., V] on every rank."""
        lead, part = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, part)
        rows = flat.shape[0]
        gathered = mx.distributed.all_gather(flat, group=self.group)  # [N * rows, V/N]
        gathered = gathered.reshape(self.size, rows, part).transpose(1, 0, 2)
        return gathered.reshape(*lead, self.size * part)


def shard_config(cfg: TextConfig, size: int) -> TextConfig:
    """The per-rank module sizes of `cfg` split over `size` ranks (ShardError if uneven)."""
    fields = (
        "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
        "linear_num_value_heads", "intermediate_size", "moe_intermediate_size",
        "shared_expert_intermediate_size", "vocab_size",
    )  # fmt: skip
    uneven = [f"{f}={getattr(cfg, f)}" for f in fields if getattr(cfg, f) % size]
    if uneven:
        raise ShardError(f"cannot split over {size} ranks: {', '.join(uneven)} not divisible")
    split = {f: getattr(cfg, f) // size for f in fields if f != "vocab_size"}
    return replace(cfg, **split)


# --------------------------------------------------------------------------- weights

# A module path (weight name without .weight / .scales / .biases) -> how it is split.
# "rows": output dimension (axis -2 of a matrix, axis 0 of a vector), "cols": input
# dimension (last axis), "qkv": rows in three head-split segments [q | k | v].
_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"self_attn\.(q_proj|k_proj|v_proj)$"), "rows"),
    (re.compile(r"self_attn\.o_proj$"), "cols"),
    (re.compile(r"linear_attn\.(in_proj_qkv|conv1d)$"), "qkv"),
    (re.compile(r"linear_attn\.(in_proj_z|in_proj_b|in_proj_a|A_log|dt_bias)$"), "rows"),
    (re.compile(r"linear_attn\.out_proj$"), "cols"),
    (re.compile(r"mlp\.(shared_expert\.)?(gate_proj|up_proj)$"), "rows"),
    (re.compile(r"mlp\.(shared_expert\.)?down_proj$"), "cols"),
    (re.compile(r"mlp\.experts\.(gate_proj|up_proj)$"), "rows"),
    (re.compile(r"mlp\.experts\.down_proj$"), "cols"),
    (re.compile(r"^lm_head$"), "rows"),
]
_SUFFIXES = (".weight", ".scales", ".biases")


def _module_path(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _rule(name: str) -> str | None:
    path = _module_path(name)
    return next((kind for pattern, kind in _RULES if pattern.search(path)), None)


def _take(x: mx.array, axis: int, rank: int, size: int, name: str) -> mx.array:
    """Rank's equal part of x along axis."""
    length = x.shape[axis]
    if length % size:
        raise ShardError(f"{name}: dimension {length} does not split over {size} ranks")
    part = length // size
    index = [slice(None)] * x.ndim
    index[axis] = slice(rank * part, (rank + 1) * part)
    return x[tuple(index)]


def _take_segments(x: mx.array, sizes: list[int], rank: int, size: int, name: str) -> mx.array:
    """Rank's part of each of the row segments `sizes` (axis -2, or 0 for vectors)."""
    axis = 0 if x.ndim == 1 else x.ndim - 2  # conv1d [C, K]: channels are rows too
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        index = [slice(None)] * x.ndim
        index[axis] = slice(lo, hi)
        parts.append(_take(x[tuple(index)], axis, rank, size, name))
    return mx.concatenate(parts, axis=axis)


def shard_tensor(name: str, x: mx.array, cfg: TextConfig, rank: int, size: int) -> mx.array:
    """Rank's slice of checkpoint tensor `name` (internal naming; packed quantized weights,
    scales and biases split like the weight they belong to). Unlisted tensors are whole."""
    kind = _rule(name)
    if kind is None:
        return x
    if kind == "cols":
        return _take(x, x.ndim - 1, rank, size, name)
    if kind == "rows":
        return _take(x, 0 if x.ndim == 1 else x.ndim - 2, rank, size, name)
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return _take_segments(x, [key_dim, key_dim, value_dim], rank, size, name)


def shard_weights(
    cfg: TextConfig, rank: int, size: int
) -> Callable[[dict[str, mx.array], dict | None], None]:
    """A loader transform (models/loader.load_checkpoint): replaces every tensor by this
    rank's slice, lazily (only the slices are materialised). `cfg` is the full config.
    A tied checkpoint gets `lm_head.*` sliced from the embedding (and its quantization)."""

    def transform(weights: dict[str, mx.array], quantization: dict | None) -> None:
        if cfg.tie_word_embeddings:
            for suffix in _SUFFIXES:
                if f"embed_tokens{suffix}" in weights:
                    weights[f"lm_head{suffix}"] = weights[f"embed_tokens{suffix}"]
            if quantization and "embed_tokens.weight" in quantization:
                quantization["lm_head.weight"] = quantization["embed_tokens.weight"]
        for name, value in list(weights.items()):
            weights[name] = shard_tensor(name, value, cfg, rank, size)

    return transform
