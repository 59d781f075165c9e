"""The runner's image work: vision features of the rows being prefilled, and the input
embeddings and 3-D positions of prefill chunks that hold image tokens.

The scheduler hands out tower work in blocks (PrefillChunk.vision), so a large image's
pass may spread over several steps next to decoding rows: a pass between steps is held
here as a VisionPass. Whole passes of one step run as one batched tower call. Features
[tokens, H] stay here until the chunks that splice them have covered the image (an
image's tokens may span several chunks), and are dropped with the row otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import numpy as np

from deltaserve.engine.plan import NewRow, PrefillChunk, VisionWork
from deltaserve.models.qwen35 import Qwen35Model
from deltaserve.models.vision import VisionPass, VisionTower


class VisionInputs:
    """Owned by the runner; one engine thread calls it. `rows` arguments: the runner's
    rows as the plans introduced them (NewRow: prompt and images)."""

    def __init__(self, model: Qwen35Model, tower: VisionTower | None, dtype: mx.Dtype) -> None:
        self.model = model
        self.tower = tower
        self.dtype = dtype
        self._features: dict[tuple[str, int], mx.array] = {}  # (row id, image) -> [T, H]
        self._passes: dict[tuple[str, int], VisionPass] = {}  # passes between stages

    def encode(self, chunks: Sequence[PrefillChunk], rows: Mapping[str, NewRow]) -> list[mx.array]:
        """Queue the step's tower work; returns the arrays it produces (lazy) so the step
        computes them even when no chunk of this step splices them yet."""
        work = [(c.row_id, w) for c in chunks for w in c.vision]
        if not work:
            return []
        assert self.tower is not None, "images scheduled without a vision tower"
        depth = len(self.tower.blocks)
        whole = [(r, w.image) for r, w in work if w.start == 0 and w.stop == depth]
        out = self._encode_whole(whole, rows) if whole else []
        for row_id, w in work:
            if w.start > 0 or w.stop < depth:
                out.append(self._stage(row_id, w, rows[row_id]))
        return out

    def _encode_whole(
        self, todo: list[tuple[str, int]], rows: Mapping[str, NewRow]
    ) -> list[mx.array]:
        """Whole passes: every image in one tower call (on a GPU one compiled trace)."""
        images = [rows[row_id].media.images[i] for row_id, i in todo]
        patches = np.concatenate([image.patches for image in images], axis=0)
        features = self.tower(mx.array(patches, dtype=self.dtype), [im.grid for im in images])
        bounds = np.cumsum([image.num_tokens for image in images])[:-1].tolist()
        parts = mx.split(features.astype(self.dtype), bounds, axis=0)
        self._features.update(zip(todo, parts, strict=True))
        return parts

    def _stage(self, row_id: str, work: VisionWork, row: NewRow) -> mx.array:
        """Blocks [start, stop) of one image's pass; the merger too once the last ran."""
        key = (row_id, work.image)
        if work.start == 0:
            image = row.media.images[work.image]
            self._passes[key] = self.tower.begin(mx.array(image.patches, self.dtype), [image.grid])
        state = self._passes[key]
        self.tower.advance(state, work.start, work.stop)
        if work.stop < len(self.tower.blocks):
            return state.x
        del self._passes[key]
        self._features[key] = self.tower.finish(state).astype(self.dtype)
        return self._features[key]

    def positions(
        self, members: Sequence[PrefillChunk], pads: Sequence[int], rows: Mapping[str, NewRow]
    ) -> mx.array | None:
        """[3, P, L] positions of a group whose rows hold images (None: text only, the
        caller's plain positions apply). Padding columns get position 0 (masked)."""
        if all(rows[c.row_id].media is None for c in members):
            return None
        length = max(c.length for c in members)
        out = np.zeros((3, len(members), length), dtype=np.int32)
        for p, (chunk, pad) in enumerate(zip(members, pads, strict=True)):
            media = rows[chunk.row_id].media
            end = chunk.start + chunk.length
            if media is not None:
                out[:, p, pad:] = media.positions[:, chunk.start : end]
            else:
                out[:, p, pad:] = np.arange(chunk.start, end, dtype=np.int32)
        return mx.array(out)

    def embeds(
        self,
        tokens: mx.array,
        members: Sequence[PrefillChunk],
        pads: Sequence[int],
        rows: Mapping[str, NewRow],
    ) -> mx.array | None:
        """[P, L, H] input embeddings with image features spliced over the image tokens of
        the group's chunks; None when no chunk holds an image token."""
        length = tokens.shape[1]
        take = np.zeros((len(members), length), dtype=np.int32)  # row of `table` per column
        is_image = np.zeros((len(members), length), dtype=bool)
        table: list[mx.array] = []
        offset = 0
        for p, (chunk, pad) in enumerate(zip(members, pads, strict=True)):
            media = rows[chunk.row_id].media
            if media is None:
                continue
            end = chunk.start + chunk.length
            for i, (a, b) in enumerate(media.spans):
                lo, hi = max(a, chunk.start), min(b, end)
                if lo >= hi:
                    continue
                table.append(self._features[(chunk.row_id, i)][lo - a : hi - a])
                cols = slice(pad + lo - chunk.start, pad + hi - chunk.start)
                take[p, cols] = np.arange(offset, offset + hi - lo)
                is_image[p, cols] = True
                offset += hi - lo
        if not table:
            return None
        embeds = self.model.embed_tokens(tokens)
        spliced = mx.concatenate(table, axis=0)[mx.array(take)]
        return mx.where(mx.array(is_image)[..., None], spliced, embeds)

    def release(self, chunks: Sequence[PrefillChunk], rows: Mapping[str, NewRow]) -> None:
        """Forget features every chunk of their image has used (the step's graph keeps
        what it still reads)."""
        for chunk in chunks:
            media = rows[chunk.row_id].media
            if media is None:
                continue
            end = chunk.start + chunk.length
            for i, (_, b) in enumerate(media.spans):
                if b <= end:
                    self._features.pop((chunk.row_id, i), None)

    def forget(self, row_ids: Sequence[str]) -> None:
        """Drop the features and passes of freed rows."""
        done = set(row_ids)
        for table in (self._features, self._passes):
            for key in [k for k in table if k[0] in done]:
                del table[key]

    def clear(self) -> None:
        self._features.clear()
        self._passes.clear()
