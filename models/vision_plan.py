"""Where each patch of a vision-tower call sits: pure numpy, computed once per call.

For the images of one call (grids (t, h, w) in patches) this gives what the tower needs
beside the pixels: each patch's (row, col) in its frame for the 2-D rotary, the 4 taps
and weights that resample the learned square position table to the frame's grid
(bilinear, align_corners=True, as transformers' vision_utils), and how frames are
regrouped so that frames of one size attend as one batched call.

Patch order within a frame is the image processor's: 2x2 merge blocks row-major, and in
each block its patches row-major, i.e. (block_row, block_col, in_row, in_col).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

Grid = tuple[int, int, int]  # (t, h, w) in patches


class _Geometry(Protocol):
    spatial_merge_size: int
    num_position_embeddings: int


@dataclass(frozen=True)
class FramePlan:
    """Per-call index arrays, all in the tower's run order (frames grouped by size)."""

    num_patches: int
    # (frames, patches per frame) of each attention call, in run order
    groups: tuple[tuple[int, int], ...]
    order: np.ndarray | None  # [N] input patch of each run row; None when unchanged
    restore: np.ndarray | None  # [N / m^2] run row of each merged output in input order
    rows_cols: np.ndarray  # [N, 2] int32 patch (row, col) in its frame
    interp_index: np.ndarray  # [N, 4] int32 rows of the position table
    interp_weight: np.ndarray  # [N, 4] float32 their bilinear weights

    @classmethod
    def build(cls, cfg: _Geometry, grids: Sequence[Grid]) -> FramePlan:
        merge = cfg.spatial_merge_size
        side = int(round(cfg.num_position_embeddings**0.5))
        frames = [(h, w) for t, h, w in grids for _ in range(t)]  # each image's t frames
        if not frames or any(h % merge or w % merge for h, w in frames):
            raise ValueError(f"grids {list(grids)}: need >= 1 image, h and w multiples of {merge}")
        lengths = [h * w for h, w in frames]
        sizes = list(dict.fromkeys(lengths))  # distinct frame sizes, first seen first
        ranked = sorted(range(len(frames)), key=lambda f: sizes.index(lengths[f]))
        groups = tuple((lengths.count(size), size) for size in sizes)
        starts = np.cumsum([0, *lengths])
        order = np.concatenate([np.arange(starts[f], starts[f + 1]) for f in ranked])
        merged = order[:: merge * merge] // (merge * merge)  # input merged row of each run row
        spots = [_frame_spots(h, w, merge, side) for h, w in (frames[f] for f in ranked)]
        identity = ranked == list(range(len(frames)))
        return cls(
            num_patches=int(starts[-1]),
            groups=groups,
            order=None if identity else order.astype(np.int32),
            restore=None if identity else np.argsort(merged).astype(np.int32),
            rows_cols=np.concatenate([s[0] for s in spots]),
            interp_index=np.concatenate([s[1] for s in spots]),
            interp_weight=np.concatenate([s[2] for s in spots]),
        )


def _frame_spots(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, ...]:
    """One frame's rows_cols [h*w, 2], interp_index [h*w, 4], interp_weight [h*w, 4]."""
    grid_rows, grid_cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = (h // merge, merge, w // merge, merge)  # -> (block_row, block_col, in_row, in_col)
    rows = grid_rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    cols = grid_cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    row_taps, row_weights = _axis_taps(rows, h, side)
    col_taps, col_weights = _axis_taps(cols, w, side)
    # outer product of the per-axis taps: (r0, c0), (r0, c1), (r1, c0), (r1, c1)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return np.stack([rows, cols], axis=1).astype(np.int32), index.astype(np.int32), weight


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Linear interpolation of `size` evenly spread points over a `side`-long table with
    the end points on its ends (align_corners=True): taps [n, 2] and weights [n, 2]."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    frac = (src - floor).astype(np.float32)
    low = floor.astype(np.int64)
    taps = np.stack([low, np.minimum(low + 1, side - 1)], axis=1)
    weights = np.stack([1.0 - frac, frac], axis=1).astype(np.float32)
    return taps, weights
