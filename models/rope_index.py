"""3-D rotary positions (T, H, W) of a Qwen3.5 prompt with images, and its rope delta.

Pure numpy; equal to transformers' `Qwen3_5Model.get_rope_index` for a prompt whose image
runs are separated by other tokens (the chat template puts <|vision_start|> and
<|vision_end|> around each):
- text token: one position shared by all three axes, then the position advances by 1;
- image of grid (t, h, w) patches, merged m x m into t * (h/m) * (w/m) tokens in
  row-major (t, h', w') order: T = start + frame, H = start + row, W = start + col; then
  the position advances by max(h, w) / m (Qwen3.5's rule; it ignores t);
- rope delta = max position + 1 - L. A token generated after the prompt at sequence index
  k has position k + delta on every axis (delta <= 0: an image of n tokens spans only
  about sqrt(n) positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Grid = tuple[int, int, int]  # (t, h, w) in patches


def image_token_count(grid: Grid, spatial_merge_size: int) -> int:
    """Image-pad tokens of one image: t * h * w / merge^2."""
    t, h, w = grid
    return t * (h // spatial_merge_size) * (w // spatial_merge_size)


def image_runs(token_ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of `image_token_id` in `token_ids`."""
    is_image = np.concatenate([[False], token_ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])  # alternating starts and ends
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2], strict=True)]


def mrope_positions(
    token_ids: Sequence[int] | np.ndarray,
    grids: Sequence[Grid],
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """Positions [3, L] int32 (T, H, W) of a prompt and its rope delta.

    The i-th maximal run of `image_token_id` is image i with patch grid grids[i]; its
    length must be that image's token count (ValueError otherwise, or when the runs and
    grids differ in number).
    """
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(grids):
        raise ValueError(f"{len(runs)} image-token runs in the prompt for {len(grids)} images")
    positions = np.empty((3, len(ids)), dtype=np.int32)
    current, cursor = 0, 0  # next position to hand out; next token index to fill
    for (start, end), grid in zip(runs, grids, strict=True):
        count = image_token_count(grid, spatial_merge_size)
        if end - start != count:
            raise ValueError(f"grid {grid} needs {count} image tokens; its run has {end - start}")
        positions[:, cursor:start] = current + np.arange(start - cursor, dtype=np.int32)
        current += start - cursor
        positions[:, start:end] = current + _image_offsets(grid, spatial_merge_size)
        current += max(grid[1], grid[2]) // spatial_merge_size
        cursor = end
    positions[:, cursor:] = current + np.arange(len(ids) - cursor, dtype=np.int32)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta


def decode_positions(start: int, length: int, rope_delta: int) -> np.ndarray:
    """[3, length] int32 positions of tokens at sequence indices start .. start+length-1
    that follow a prompt (text after the prompt: index + delta on every axis)."""
    row = np.arange(start, start + length, dtype=np.int32) + rope_delta
    return np.broadcast_to(row, (3, length)).copy()


def _image_offsets(grid: Grid, spatial_merge_size: int) -> np.ndarray:
    """[3, t * h' * w'] (frame, row, col) of each merged token, row-major over (t, h', w')."""
    t, h, w = grid
    frames, rows, cols = np.meshgrid(
        np.arange(t), np.arange(h // spatial_merge_size), np.arange(w // spatial_merge_size),
        indexing="ij",
    )  # fmt: skip
    return np.stack([frames, rows, cols]).reshape(3, -1).astype(np.int32)
