"""Qwen3.5 vision tower (HF `model.visual`) in MLX (engine/vision/features.py splices its
features into the prompt).

patches [N, C*T*P*P] in the image processor's order (per image: frames, then 2x2 merge
blocks row-major, then a block's 4 patches; each patch flattened as (C, T, P, P)) ->
patch embed (the Conv3d with kernel = stride, as one matmul) + learned position table
resampled bilinearly to each grid -> pre-LN ViT blocks with 2-D rotary, attention only
within a frame -> merger (LayerNorm, 2x2 merge, MLP) -> [N / merge^2, out_hidden].

Several images run in one call: frames of equal patch count attend as one batched
attention [frames, heads, L, D] (no mask, no wasted scores); frames are regrouped by size
before the blocks and the features put back in input order after the merger.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from deltaserve.kernels.platform import current_platform
from deltaserve.models.chat_format import IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID
from deltaserve.models.vision_plan import FramePlan, Grid

logger = logging.getLogger(__name__)
_LOG2E = 1.0 / math.log(2.0)
Rope = tuple[mx.array, mx.array]  # cos, sin [N, 1, 1, head_dim] float32
Groups = tuple[tuple[int, int], ...]  # (frames, patches per frame) per attention call


@dataclass(frozen=True)
class VisionConfig:
    """Shapes of the vision tower plus the prompt tokens that carry images."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_position_embeddings: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    image_token_id: int = IMAGE_PAD_ID
    video_token_id: int = VIDEO_PAD_ID
    vision_start_token_id: int = VISION_START_ID
    vision_end_token_id: int = VISION_END_ID

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def num_tokens(self, grid: Grid) -> int:
        """Image-pad tokens (merged features) of one image of patch grid (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.spatial_merge_size**2

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig | None:
        """From a composite config.json (HF or mlx-vlm); None without a vision_config."""
        v = raw.get("vision_config")
        if not v:
            return None
        rope = v.get("rope_parameters") or {}
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {act!r} not supported ({', '.join(_ACTIVATIONS)})")
        return cls(
            depth=int(v.get("depth") or v["num_hidden_layers"]),
            hidden_size=int(v["hidden_size"]),
            num_heads=int(v.get("num_heads") or v["num_attention_heads"]),
            intermediate_size=int(v["intermediate_size"]),
            num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
            out_hidden_size=int(v["out_hidden_size"]),
            patch_size=int(v.get("patch_size", 16)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            in_channels=int(v.get("in_channels", 3)),
            hidden_act=act,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=int(raw.get("image_token_id", IMAGE_PAD_ID)),
            video_token_id=int(raw.get("video_token_id", VIDEO_PAD_ID)),
            vision_start_token_id=int(raw.get("vision_start_token_id", VISION_START_ID)),
            vision_end_token_id=int(raw.get("vision_end_token_id", VISION_END_ID)),
        )


def _gelu_tanh(x: mx.array) -> mx.array:
    """GELU, tanh approximation: 0.5 x (1 + tanh(u)) = x / (1 + 2^(-2u log2 e)) with
    u = c (x + 0.044715 x^3). On CPU 2^y is ~5x faster than mx.tanh / mx.exp (see
    kernels/fastmath.py): 22 ms instead of 88 for [784, 3072] float32."""
    if not current_platform().is_cpu:
        return nn.gelu_approx(x)
    c = 2.0 * math.sqrt(2.0 / math.pi) * _LOG2E
    return x / (1.0 + mx.power(2.0, x * (x * x * (-c * 0.044715) - c)))


def _attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Bidirectional softmax attention, [frames, heads, L, D] each.

    On CPU mx.fast's SDPA is plain ops whose softmax spends most of its time in exp over
    the [L, L] scores: a base-2 softmax with the scale folded into q is ~1.6x faster
    (155 vs 246 ms for 12 heads x 784 patches).
    """
    if not current_platform().is_cpu:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    scores = (q * (scale * _LOG2E)) @ k.swapaxes(-1, -2)  # [frames, heads, L, L]
    weights = mx.power(2.0, scores - scores.max(axis=-1, keepdims=True))
    return (weights @ v) / weights.sum(axis=-1, keepdims=True)


_ACTIVATIONS = {"gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh, "gelu": nn.gelu}


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride over one patch = a Linear over the flattened patch."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


class VisionAttention(nn.Module):
    """Fused qkv (with bias), 2-D rotary on q and k, bidirectional attention per frame."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def __call__(self, x: mx.array, rope: Rope, groups: Groups) -> mx.array:
        """x [N, W] in frame-grouped order; rope: cos, sin [N, 1, 1, D] float32."""
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)
        qk = _rotate(qkv[:, :2], *rope)  # [N, 2, heads, D]
        q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        outs, start = [], 0
        for frames, length in groups:  # one attention per frame size
            end = start + frames * length
            per_frame = [_by_frame(a[start:end], frames, length) for a in (q, k, v)]
            o = _attention(*per_frame, self.scale)
            outs.append(o.swapaxes(1, 2).reshape(end - start, -1))  # back to [rows, W]
            start = end
        return self.proj(outs[0] if len(outs) == 1 else mx.concatenate(outs))


def _by_frame(a: mx.array, frames: int, length: int) -> mx.array:
    """[frames * L, heads, D] -> [frames, heads, L, D]."""
    return a.reshape(frames, length, *a.shape[1:]).swapaxes(1, 2)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half rotary over the whole head dim, in float32 (as transformers)."""
    x32 = x.astype(mx.float32)
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self._act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self._act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)); then + mlp(norm2(x)). LayerNorm eps 1e-6."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def __call__(self, x: mx.array, rope: Rope, groups: Groups) -> mx.array:
        x = x + self.attn(self.norm1(x), rope, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then each 2x2 block's 4 consecutive patches as one row -> fc1, exact
    GELU (nn.GELU() in transformers, unlike the blocks' tanh form), fc2 -> out_hidden."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, cfg.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.linear_fc1.weight.shape[1])
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


MAX_TRACES = 16  # compiled encoder traces kept (one per frame layout: sizes and counts)


class _Traces:
    """Compiled encoders by frame layout (not a dict: nn.Module would file a dict
    attribute into its parameter tree)."""

    def __init__(self) -> None:
        self.by_groups: dict[Groups, Callable] = {}


@dataclass
class VisionPass:
    """A vision-tower pass between stages: the hidden state [N, W] after `blocks_done`
    blocks, with the frame plan and rotary tables the remaining blocks use."""

    plan: FramePlan
    x: mx.array
    rope: Rope
    blocks_done: int = 0


class VisionTower(nn.Module):
    """The whole tower: pixel patches of several images -> their merged features."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = [VisionBlock(cfg) for _ in range(cfg.depth)]
        self.merger = PatchMerger(cfg)
        self.compiled = not current_platform().is_cpu  # see _encoder
        self._traces = _Traces()

    def __call__(self, patches: mx.array, grids: Sequence[Grid]) -> mx.array:
        """patches [sum t*h*w, C*T*P*P] of the images in order, grids their (t, h, w).

        Returns [sum t*h*w / merge^2, out_hidden]: image i's features are rows
        sum_{j<i} num_tokens(grid_j) onward, in the order its image-pad tokens take them.
        """
        state = self.begin(patches, grids)
        out = self._encoder(state.plan.groups)(state.x, *state.rope)
        return out if state.plan.restore is None else out[mx.array(state.plan.restore)]

    def begin(self, patches: mx.array, grids: Sequence[Grid]) -> VisionPass:
        """A pass in stages (a caller that bounds each step's work runs a few blocks at
        a time): the patch embedding and position table applied, no block run yet."""
        plan = FramePlan.build(self.config, grids)
        if patches.shape != (plan.num_patches, self.config.patch_dim):
            raise ValueError(f"patches {patches.shape} do not match grids {list(grids)}")
        x = self.patch_embed(patches.astype(self.patch_embed.proj.weight.dtype))
        if plan.order is not None:
            x = x[mx.array(plan.order)]
        x = x + self._position_embedding(plan).astype(x.dtype)
        return VisionPass(plan, x, self._rotary(plan))

    def advance(self, state: VisionPass, start: int, stop: int) -> None:
        """Run blocks [start, stop) of a staged pass (state.x [N, W] is replaced, lazily)."""
        assert start == state.blocks_done, "blocks run in order"
        for block in self.blocks[start:stop]:
            state.x = block(state.x, state.rope, state.plan.groups)
        state.blocks_done = stop

    def finish(self, state: VisionPass) -> mx.array:
        """The merger after the last block: the features, as __call__ returns them."""
        assert state.blocks_done == len(self.blocks), "blocks left to run"
        out = self.merger(state.x)
        return out if state.plan.restore is None else out[mx.array(state.plan.restore)]

    def _encoder(self, groups: Groups) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
        """blocks + merger for one frame layout: (x [N, W], cos, sin) -> [N / m^2, out].
        Compiled per layout when `compiled` (a GPU pays per op: ~20 per block eagerly)."""
        if not self.compiled:
            return partial(self._encode, groups)
        traces = self._traces.by_groups
        if groups not in traces:
            if len(traces) >= MAX_TRACES:
                traces.clear()  # bound the memory of traces of one-off image sizes
            traces[groups] = mx.compile(partial(self._encode, groups))
        return traces[groups]

    def _encode(self, groups: Groups, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        for block in self.blocks:
            x = block(x, (cos, sin), groups)
        return self.merger(x)

    def _position_embedding(self, plan: FramePlan) -> mx.array:
        """[N, W]: the learned table bilinearly resampled at each patch (4 taps)."""
        taps = self.pos_embed.weight[mx.array(plan.interp_index)]  # [N, 4, W]
        return (taps * mx.array(plan.interp_weight)[..., None]).sum(axis=1)

    def _rotary(self, plan: FramePlan) -> tuple[mx.array, mx.array]:
        """cos, sin [N, 1, 1, D] float32: head dim = [h freqs, w freqs] twice."""
        quarter = self.config.head_dim // 4
        exponent = np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)
        inv_freq = mx.array(1.0 / self.config.rope_theta**exponent)  # [D/4]
        angles = mx.array(plan.rows_cols)[..., None].astype(mx.float32) * inv_freq
        angles = angles.reshape(-1, 2 * quarter)  # [N, D/2]: row angles, then col angles
        angles = mx.concatenate([angles, angles], axis=-1)[:, None, None, :]
        return mx.cos(angles), mx.sin(angles)


# --------------------------------------------------------------------------- loading


def load_vision(
    config_raw: dict[str, Any], vision_weights: dict[str, mx.array], dtype: mx.Dtype | None = None
) -> VisionTower | None:
    """The tower of a checkpoint, or None when it has no vision_config or no vision
    weights (text-only conversions keep the vision_config but drop the tensors).

    config_raw: the whole config.json. vision_weights: tensors named below `model.visual.`
    (HF) or `vision_tower.` (mlx-vlm), as models/loader.py hands them over. The Conv3d
    weight is HF [W, C, T, P, P] or mlx-vlm [W, T, P, P, C], told apart by shape; affine-
    quantized tensors are dequantized. dtype casts every weight (None keeps the stored one).
    """
    cfg = VisionConfig.from_dict(config_raw)
    if cfg is None or not vision_weights:
        if cfg is not None:
            logger.info("config has a vision_config but the checkpoint no vision weights")
        return None
    weights = _dequantized(vision_weights, config_raw.get("quantization"))
    weights = {k: v for k, v in weights.items() if not k.endswith("position_ids")}
    weights["patch_embed.proj.weight"] = _patch_matrix(weights["patch_embed.proj.weight"], cfg)
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    tower = VisionTower(cfg)
    tower.load_weights(list(weights.items()), strict=True)
    mx.eval(tower.parameters())
    return tower


def _patch_matrix(conv: mx.array, cfg: VisionConfig) -> mx.array:
    """The Conv3d weight as [W, C*T*P*P], flattened in the patches' (C, T, P, P) order."""
    c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
    width = cfg.hidden_size
    if conv.shape == (width, c, t, p, p):  # HF / PyTorch
        return conv.reshape(width, -1)
    if conv.shape == (width, t, p, p, c):  # mlx-vlm: channels last
        return conv.transpose(0, 4, 1, 2, 3).reshape(width, -1)
    if conv.shape == (width, c * t * p * p):
        return conv
    expected = (width, c, t, p, p)
    raise ValueError(f"patch_embed.proj.weight has shape {conv.shape}; expected {expected}")


def _dequantized(weights: dict[str, mx.array], quant: dict | None) -> dict[str, mx.array]:
    """Affine-quantized (weight, scales, biases) triples as plain float weights."""
    out = {}
    for key, value in weights.items():
        module = key.rsplit(".", 1)[0]
        if key.endswith((".scales", ".biases")) and f"{module}.weight" in weights:
            continue  # consumed with its packed weight
        if not key.endswith(".weight") or f"{module}.scales" not in weights:
            out[key] = value
            continue
        if not quant:
            raise ValueError(f"vision tensor {key} is quantized; config.json has no quantization")
        spec = quant.get(f"vision_tower.{module}")
        spec = spec if isinstance(spec, dict) else quant
        out[key] = mx.dequantize(
            value, weights[f"{module}.scales"], weights.get(f"{module}.biases"),
            group_size=int(spec["group_size"]), bits=int(spec["bits"]),
            mode=spec.get("mode", "affine"),
        )  # fmt: skip
    return out
