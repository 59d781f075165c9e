"""Images of a prompt as the engine schedules them: where their tokens are, their 3-D
rotary positions, what the vision tower costs, and the prefix-cache key.

Pure Python and numpy (no mx.array): `prepare_media` runs once per request when it is
added, and the result rides on the scheduler's Request (the scheduler reads spans and
costs; the runner reads images and positions).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from engine.types import GenerationRequest, ImageInput, InvalidRequestError
from models.config import TextConfig
from models.rope_index import image_runs, mrope_positions
from models.vision import VisionConfig

# Fewest prompt tokens a chunk that runs an image's tower takes (past the tower's cost)
MIN_TOKENS_WITH_IMAGE = 16


@dataclass(frozen=True, eq=False)
class PromptMedia:
    """A prompt's images. Written by prepare_media; read by the scheduler and runner."""

    images: tuple[ImageInput, ...]
    spans: tuple[tuple[int, int], ...]  # [start, end) of image i's tokens in the prompt
    positions: np.ndarray  # [3, L] int32 (T, H, W) rotary positions of the prompt
    rope_delta: int  # a generated token at index k has position k + rope_delta (all axes)
    # prompt ids with each image's tokens replaced by ids drawn from its digest: the
    # prefix cache keys on these, so equal pad tokens of different images never match
    key_ids: tuple[int, ...]
    vision_tokens: tuple[int, ...]  # each image's tower pass, in prefill-token equivalents
    vision_bytes: int  # peak activation + feature memory of the tower over these images

    def cut(self, first: int, start: int, end: int, budget: int) -> tuple[int, tuple[int, ...]]:
        """Where a chunk [start, end) given `budget` token equivalents ends once it pays
        for the tower passes of the images it reaches (from index `first` on), and those
        images. It stops before an image it cannot pay for; a chunk that starts inside an
        unpaid image pays for it whatever the budget (the prompt must advance)."""
        while True:
            new = self.new_images(first, end)
            cost = sum(self.vision_tokens[i] for i in new)
            if not new or end - start + cost <= budget:
                return end, tuple(new)
            if self.spans[new[-1]][0] > start:
                end = self.spans[new[-1]][0]  # leave the last image to a later chunk
                continue
            least = start + min(end - start, MIN_TOKENS_WITH_IMAGE)
            return max(least, min(end, start + budget - cost)), tuple(new)

    def new_images(self, first: int, end: int) -> list[int]:
        """Images from index `first` on whose tokens start before prompt position `end`."""
        return [i for i in range(first, len(self.spans)) if self.spans[i][0] < end]

    def first_needed(self, position: int) -> int:
        """Index of the first image with tokens at or after `position` (a cache hit
        resumes there: earlier images' tokens are already in the restored state)."""
        return next((i for i, (_, end) in enumerate(self.spans) if end > position), len(self.spans))


def prepare_media(
    request: GenerationRequest, text: TextConfig, vision: VisionConfig | None
) -> PromptMedia | None:
    """Check a request's images against its prompt; None for a text-only prompt."""
    ids = request.prompt_ids
    image_id = vision.image_token_id if vision is not None else None
    if not request.images:
        if image_id is not None and image_id in ids:
            raise InvalidRequestError(
                "the prompt holds image-pad tokens but the request has no images", "messages"
            )
        return None
    if vision is None:
        raise InvalidRequestError(
            "this model has no vision tower: images are not supported", "messages"
        )
    spans = image_runs(np.asarray(ids), image_id)
    counts = [end - start for start, end in spans]
    wanted = [image.num_tokens for image in request.images]
    if counts != wanted:
        raise InvalidRequestError(
            f"the prompt's image-pad runs {counts} do not match the images' tokens {wanted}",
            "messages",
        )
    grids = [image.grid for image in request.images]
    positions, delta = mrope_positions(ids, grids, image_id, vision.spatial_merge_size)
    key = list(ids)
    for (start, end), image in zip(spans, request.images, strict=True):
        key[start:end] = _digest_ids(image.digest, end - start)
    per_token = text_flops_per_token(text)
    return PromptMedia(
        images=request.images,
        spans=tuple(spans),
        positions=positions,
        rope_delta=delta,
        key_ids=tuple(key),
        vision_tokens=tuple(max(1, round(vision_flops(vision, g) / per_token)) for g in grids),
        vision_bytes=sum(vision_activation_bytes(vision, g) for g in grids),
    )


def _digest_ids(digest: str, count: int) -> list[int]:
    """`count` negative ids (never real tokens) derived from an image digest and index."""
    seed = int.from_bytes(hashlib.sha256(digest.encode()).digest()[:7], "little")
    return [-1 - ((seed + i) % 2**62) for i in range(count)]


def text_flops_per_token(cfg: TextConfig) -> float:
    """Matmul FLOPs of one token through the language model (LM head excluded): the unit
    the scheduler's step-cost model measures prefill in."""
    h = cfg.hidden_size
    attn = h * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    attn += cfg.num_attention_heads * cfg.head_dim * h
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    delta = h * (2 * key + 2 * value + 2 * cfg.linear_num_value_heads) + value * h
    if cfg.is_moe:
        mlp = 3 * h * (cfg.num_experts_per_tok * cfg.moe_intermediate_size)
        mlp += 3 * h * cfg.shared_expert_intermediate_size + h * cfg.num_experts
    else:
        mlp = 3 * h * cfg.intermediate_size
    full = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    linear = cfg.num_hidden_layers - full
    return 2.0 * (full * attn + linear * delta + cfg.num_hidden_layers * mlp)


def vision_flops(cfg: VisionConfig, grid: tuple[int, int, int]) -> float:
    """Matmul + attention FLOPs of one image through the vision tower."""
    t, h, w = grid
    n, width = t * h * w, cfg.hidden_size
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2 * width
    block = 4 * width * width + 2 * width * cfg.intermediate_size
    attention = 2 * (n / t) * width  # scores and weighted values, within each frame
    merged = width * cfg.spatial_merge_size**2
    merger = (n / cfg.spatial_merge_size**2) * (merged * merged + merged * cfg.out_hidden_size)
    return 2.0 * (n * (patch + cfg.depth * (block + attention)) + merger)


def vision_activation_bytes(cfg: VisionConfig, grid: tuple[int, int, int]) -> int:
    """Peak float32 memory of one image's tower pass: a block's activations (hidden, qkv,
    MLP) plus one frame's attention scores (materialized where no fused kernel runs)."""
    t, h, w = grid
    n, width = t * h * w, cfg.hidden_size
    activations = n * (6 * width + 2 * cfg.intermediate_size)
    scores = cfg.num_heads * (n // t) ** 2
    features = (n // cfg.spatial_merge_size**2) * cfg.out_hidden_size
    return 4 * (activations + scores + features)
