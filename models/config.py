"""Qwen3.5 text-model configuration, parsed once from a checkpoint's config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Qwen3.5 text/VL model this package implements."""


@dataclass(frozen=True)
class TextConfig:
    """Shapes and constants of the Qwen3.5 language model (dense or MoE)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int
    # MoE (num_experts == 0 means dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def is_full_attention(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "full_attention"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TextConfig:
        """Build from a HF or mlx-community config.json (top level or its text_config)."""
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; deltaserve serves {SUPPORTED_MODEL_TYPES}"
            )
        text = dict(raw.get("text_config") or raw)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        num_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if not layer_types:
            # Older configs only carry the interval: every interval-th layer is full attention.
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(num_layers)
            ]
        if len(layer_types) != num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        return cls(
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=head_dim,
            intermediate_size=int(text.get("intermediate_size") or 0),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            layer_types=tuple(layer_types),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e7))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
            ),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            num_experts=int(text.get("num_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            eos_token_ids=eos_ids,
            extra={k: v for k, v in raw.items() if k.endswith("token_id")},
        )
