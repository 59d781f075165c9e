"""Images of a prompt as the engine schedules them: where their tokens are, their 3-D
rotary positions, what the vision tower costs, and the prefix-cache key.

Pure Python and numpy (no mx.array): `prepare_media` runs once per request when it is
added, and the result rides on the scheduler's Request (the scheduler reads spans and
costs; the runner reads images and positions).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from deltaserve.engine.types import GenerationRequest, ImageInput, InvalidRequestError
from deltaserve.models.config import TextConfig
from deltaserve.models.rope_index import image_runs, mrope_positions
from deltaserve.models.vision import VisionConfig


@dataclass(frozen=True)
class VisionWork:
    """Blocks [start, stop) of one image's vision-tower pass (start 0: the patch
    embedding runs first; stop = depth: the merger runs after, giving the features).
    Written by the scheduler (PromptMedia.plan), run by the runner."""

    image: int  # index into the row's images
    start: int
    stop: int


@dataclass(frozen=True)
class VisionProgress:
    """How far a prompt's tower passes are: images before `image` are encoded, and
    `blocks` blocks of image `image` have run. Written by the scheduler."""

    image: int = 0
    blocks: int = 0


@dataclass(frozen=True)
class VisionPrice:
    """What tower blocks cost in one step's plan, in prefill tokens: `scale` x their FLOP
    estimate (block_tokens), as the step-cost model measured it; and at most `limit` of
    those estimates' worth of tower work in the step (None: no limit). Written by the
    scheduler."""

    scale: float = 1.0
    limit: int | None = None

    def block(self, tokens: int) -> int:
        """Prefill tokens that one block of `tokens` estimated equivalents costs."""
        return max(1, math.ceil(tokens * self.scale - 1e-9))


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
    depth: int  # blocks of the vision tower
    block_tokens: tuple[int, ...]  # one block of image i's tower, in prefill-token equivalents
    vision_bytes: int  # peak activation + feature memory of the tower over these images

    def plan(
        self,
        progress: VisionProgress,
        start: int,
        end: int,
        budget: int,
        must_advance: bool,
        price: VisionPrice = VisionPrice(),
    ) -> tuple[int, tuple[VisionWork, ...], VisionProgress]:
        """A chunk from prompt position `start` (at most to `end`) within `budget` prefill
        tokens: where its tokens end, the tower blocks it runs, and the progress after
        it. Tokens stop at the first image whose tower has not finished; blocks of that
        image then take what the budget affords at `price` (its tokens follow in the same
        chunk once the last block ran). `must_advance`: at least one block when the chunk
        would otherwise do nothing (the oldest prompt always advances)."""
        pos, left, work = start, budget, []
        image, blocks = progress.image, progress.blocks
        limit = price.limit if price.limit is not None else math.inf
        while True:
            wall = self.spans[image][0] if image < len(self.spans) else end
            take = max(0, min(max(pos, min(wall, end)) - pos, left))  # left < 0: forced block
            pos, left = pos + take, left - take
            if image >= len(self.spans) or pos < wall or wall >= end:
                break  # the budget ran out, or no unencoded image before `end`
            tokens, cost = self.block_tokens[image], price.block(self.block_tokens[image])
            afford = max(0, int(min(self.depth - blocks, left // cost, limit // tokens)))
            if afford == 0 and must_advance and pos == start and not work:
                afford = 1
            if afford == 0:
                break
            work.append(VisionWork(image, blocks, blocks + afford))
            left, limit = left - afford * cost, limit - afford * tokens
            blocks += afford
            if blocks < self.depth:
                break
            image, blocks = image + 1, 0
        return pos, tuple(work), VisionProgress(image, blocks)

    def cost(self, progress: VisionProgress, end: int, price: VisionPrice = VisionPrice()) -> int:
        """Prefill tokens (at `price`) of the tower blocks still to run for images before
        `end`."""
        total, blocks = 0, progress.blocks
        for i in range(progress.image, len(self.spans)):
            if self.spans[i][0] >= end:
                break
            total += (self.depth - blocks) * price.block(self.block_tokens[i])
            blocks = 0
        return total

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
                "the prompt holds image-pad tokens but the request has no images", "prompt_ids"
            )
        return None
    if vision is None:
        raise InvalidRequestError(
            "this model has no vision tower: images are not supported", "images"
        )
    spans = image_runs(np.asarray(ids), image_id)
    counts = [end - start for start, end in spans]
    wanted = [image.num_tokens for image in request.images]
    if counts != wanted:
        raise InvalidRequestError(
            f"the prompt's image-pad runs {counts} do not match the images' tokens {wanted}",
            "images",
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
        depth=vision.depth,
        block_tokens=tuple(
            max(1, round(vision_flops(vision, g) / vision.depth / per_token)) for g in grids
        ),
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
    MLP) plus two copies of one frame's attention scores (the CPU's softmax holds scores
    and weights at once; a fused GPU kernel holds none, so this overcounts there)."""
    t, h, w = grid
    n, width = t * h * w, cfg.hidden_size
    activations = n * (6 * width + 2 * cfg.intermediate_size)
    scores = 2 * cfg.num_heads * (n // t) ** 2
    features = (n // cfg.spatial_merge_size**2) * cfg.out_hidden_size
    return 4 * (activations + scores + features)
