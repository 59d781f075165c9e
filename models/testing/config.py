"""Qwen3.5 shapes (tiny test ones and the published sizes) and their config.json.

The configs mirror the published Qwen/Qwen3.5-* config.json key for key (composite
`qwen3_5` / `qwen3_5_moe` config with `text_config` and `vision_config`), so loaders,
transformers and mlx-lm read them exactly as they read the real checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from deltaserve.models.chat_format import (
    ENDOFTEXT_ID,
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
)

VOCAB_SIZE = 248320


@dataclass(frozen=True)
class Shape:
    """Text and vision dimensions of one Qwen3.5 model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_k_heads: int
    linear_v_heads: int
    linear_head_dim: int  # Dk = Dv
    intermediate: int
    tied: bool
    experts: int = 0  # 0 = dense MLP
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    vision: tuple[int, int, int, int, int] = (2, 32, 2, 64, 64)  # depth, width, heads, mlp, pos


_BIG_VISION = (27, 1152, 16, 4304, 2304)
_TINY = Shape(128, 8, 4, 2, 64, 4, 8, 32, 256, tied=False)
_MOE = {"experts": 8, "experts_per_tok": 2, "moe_intermediate": 64, "shared_intermediate": 64}
SHAPES: dict[str, Shape] = {
    "tiny": _TINY,
    "tiny-tied": replace(_TINY, tied=True),
    "tiny-moe": replace(_TINY, **_MOE),
    "small": Shape(256, 8, 4, 2, 64, 4, 8, 64, 512, tied=False),
    "small-moe": Shape(256, 8, 4, 2, 64, 4, 8, 64, 512, False, **_MOE),
    "0.8B": Shape(1024, 24, 8, 2, 256, 16, 16, 128, 3584, True, vision=(12, 768, 12, 3072, 2304)),
    "2B": Shape(2048, 24, 8, 2, 256, 16, 16, 128, 6144, True, vision=_BIG_VISION),
    "4B": Shape(2560, 32, 16, 4, 256, 16, 32, 128, 9216, True, vision=_BIG_VISION),
    "9B": Shape(4096, 32, 16, 4, 256, 16, 32, 128, 12288, False, vision=_BIG_VISION),
    "27B": Shape(5120, 64, 24, 4, 256, 16, 48, 128, 17408, False, vision=_BIG_VISION),
    "35B-A3B": Shape(
        2048, 40, 16, 2, 256, 16, 32, 128, 0, False, 256, 8, 512, 512, vision=_BIG_VISION
    ),
}
MOE_VARIANT = {"tiny": "tiny-moe", "small": "small-moe"}


def resolve_shape(shape: str, moe: bool) -> Shape:
    """The Shape for a name; `moe=True` picks the MoE sibling of a tiny/small shape."""
    name = MOE_VARIANT.get(shape, shape) if moe else shape
    if name not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if moe and not SHAPES[name].experts:
        raise ValueError(f"shape {shape!r} has no MoE variant")
    return SHAPES[name]


# --------------------------------------------------------------------------- config.json


def _mrope_section(rotary_dim: int) -> list[int]:
    """[T, H, W] frequency counts; [11, 11, 10] for the published 64-dim rotary."""
    q, r = divmod(rotary_dim // 2, 3)
    return [q + (r > 0), q + (r > 1), q]


def text_config(s: Shape) -> dict:
    """The `text_config` section, key for key like the published configs."""
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(s.layers)
    ]
    cfg = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "bfloat16", "eos_token_id": ENDOFTEXT_ID, "full_attention_interval": 4,
        "head_dim": s.head_dim, "hidden_act": "silu", "hidden_size": s.hidden,
        "initializer_range": 0.02, "layer_types": layer_types, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": s.linear_head_dim, "linear_num_key_heads": s.linear_k_heads,
        "linear_num_value_heads": s.linear_v_heads, "linear_value_head_dim": s.linear_head_dim,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text" if s.experts else "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": s.heads, "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads, "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True, "mrope_section": _mrope_section(s.head_dim // 4),
            "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": s.tied, "use_cache": True, "vocab_size": VOCAB_SIZE,
    }  # fmt: skip
    if s.experts:
        cfg.update(
            moe_intermediate_size=s.moe_intermediate, num_experts=s.experts,
            num_experts_per_tok=s.experts_per_tok, output_router_logits=False,
            router_aux_loss_coef=0.001, shared_expert_intermediate_size=s.shared_intermediate,
        )  # fmt: skip
    else:
        cfg.update(intermediate_size=s.intermediate, mlp_only_layers=[])
    return dict(sorted(cfg.items()))


def hf_config(s: Shape) -> dict:
    """The whole config.json of a Qwen3_5(Moe)ForConditionalGeneration checkpoint."""
    moe = bool(s.experts)
    depth, width, heads, mlp, positions = s.vision
    vision = {
        "deepstack_visual_indexes": [], "depth": depth, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": width, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": mlp, "model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision",
        "num_heads": heads, "num_position_embeddings": positions, "out_hidden_size": s.hidden,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return {
        "architectures": [arch], "image_token_id": IMAGE_PAD_ID,
        "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text_config(s),
        "tie_word_embeddings": s.tied, "transformers_version": "4.57.0.dev0",
        "video_token_id": VIDEO_PAD_ID, "vision_config": vision,
        "vision_end_token_id": VISION_END_ID, "vision_start_token_id": VISION_START_ID,
    }  # fmt: skip
