"""Runner: turn a SchedulerOutput into one mixed-group forward and the logits to sample."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.rows import RowStates
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.plan import PrefillChunk, SchedulerOutput
from deltaserve.engine.request import Request
from deltaserve.engine.vision.features import VisionInputs
from deltaserve.models.qwen35 import Qwen35Model
from deltaserve.models.state import ForwardGroup, text_positions


@dataclass
class _Cohort:
    """Prefill chunks that run as one left-padded [P, L] group."""

    chunk_indices: list[int]  # positions in SchedulerOutput.prefill
    row_ids: list[str]


class ModelRunner:
    """Builds groups (the decode batch [B, 1] and the step's prefill chunks), runs the
    model once, and returns logits [N, V] for the rows that sample.

    compiled: the decode batch runs through that compiled step instead of a group.
    batch_prefill: chunks run as few left-padded groups (cohorts) instead of one [1, C]
    group each: on the GPU a prefill forward costs its op count, not its tokens.
    compiled_prompts: cohorts of fresh text prompts' first chunks run through that
    compiled forward instead of a group.
    """

    def __init__(
        self,
        model: Qwen35Model,
        states: RowStates,
        compiled: CompiledDecode | None = None,
        batch_prefill: bool = False,
        vision: VisionInputs | None = None,
        compiled_prompts: CompiledPrefill | None = None,
    ) -> None:
        """vision: the image work of prompts with images (None: text only)."""
        self.model = model
        self.states = states
        self.compiled = compiled
        self.batch_prefill = batch_prefill
        self.vision = vision
        self.compiled_prompts = compiled_prompts
        self._saved: list[mx.array] = []  # prefix-cache copies not yet started

    def execute(
        self, out: SchedulerOutput, rows: dict[str, Request], prev_tokens: mx.array | None
    ) -> mx.array | None:
        """Run the step; logits follow out.sample_row_ids (a final chunk's row repeats
        for each of its forks). None when nothing samples this step. `prev_tokens`: the
        previous step's sampled tokens [N] (possibly not computed yet), for decode rows
        whose input is still pending."""
        hold = out.decode_rows_wait
        self.states.sync(out.decode_row_ids, out.freed_row_ids, out.forks, hold)
        if out.cache_loads:
            self.states.load_prefix(out.cache_loads)
        for chunk in out.prefill:
            if chunk.restore:
                self.states.restore_prefix(chunk.row_id, chunk.restore)
        features = self.vision.encode(out.prefill, rows) if self.vision is not None else []
        decode_logits = self._compiled_decode(out, prev_tokens)
        groups = []
        if out.decode_row_ids and decode_logits is None:
            groups.append(self._decode_group(out, prev_tokens))
        cohorts = self._cohorts(out.prefill)
        fresh = {i: self._compiled_prompts(out.prefill, c, rows) for i, c in enumerate(cohorts)}
        fresh = {i: run for i, run in fresh.items() if run is not None}
        eager = [c for i, c in enumerate(cohorts) if i not in fresh]
        groups += [self._prefill_group(out.prefill, c, rows) for c in eager]
        if self.vision is not None:
            self.vision.release(out.prefill, rows, out.freed_row_ids)
        hidden = self.model(groups) if groups else []
        eager_hidden = iter(hidden[len(groups) - len(eager) :])
        prefill_hidden = [
            fresh[i][0] if i in fresh else next(eager_hidden) for i in range(len(cohorts))
        ]
        last = [hidden[0][:, -1]] if out.decode_row_ids and decode_logits is None else []
        last += self._last_prefill_hidden(out.prefill, cohorts, prefill_hidden)
        logits = self.model.logits(mx.concatenate(last, axis=0)) if last else None
        if decode_logits is not None:
            parts = [decode_logits] + ([logits] if logits is not None else [])
            logits = mx.concatenate(parts, axis=0) if len(parts) > 1 else decode_logits
        layers = [layer for g in groups[: len(groups) - len(eager)] for layer in g.states]
        if decode_logits is not None:
            layers += self.states.decode.layers
        for cohort, group in zip(eager, groups[len(groups) - len(eager) :], strict=True):
            layers += self._scatter(cohort, group)
        layers += [layer for _, states in fresh.values() for s in states for layer in s.layers]
        # Start computing now (states of every group, even chunks that sample nothing, so
        # no lazy graph carries over to the next step); the sampler's work queues behind.
        pending = [a for layer in layers for a in layer.state_arrays()]
        for save in out.cache_saves:  # after _scatter: each row's own state is current
            self._saved += self.states.save_prefix(save)
        if out.cache_drop is not None:
            self.states.drop_prefix(out.cache_drop)
        pending += features  # a tower pass whose tokens come in a later chunk
        mx.async_eval(*pending, *([logits] if logits is not None else []))
        return logits

    def flush_saves(self) -> None:
        """Start computing the prefix-cache copies of the steps run so far. The engine
        calls it once a step's tokens are read back, so the copies run while the next
        step is planned and built, not ahead of the step's sampled tokens: a long prompt's
        snapshot is hundreds of small copies (CPU, small shape, 2,524 tokens: 172, 20-26
        ms right after the forward), in the step that samples its first token. The arrays
        are values of the states as saved, whenever they are computed."""
        if self._saved:
            mx.async_eval(*self._saved)
            self._saved = []
        if self.states.prefix is not None:  # the disk tier's copies, one flush behind
            self.states.prefix.write_back()

    def discard_saves(self) -> None:
        """After a failed step (the prefix cache is reset with the states)."""
        self._saved = []

    def _compiled_decode(
        self, out: SchedulerOutput, prev_tokens: mx.array | None
    ) -> mx.array | None:
        """Logits [B, V] of the decode batch through the compiled step, or None when it
        does not apply (no decode rows, compiling off, or a store kind it lacks)."""
        if not out.decode_row_ids or self.compiled is None:
            return None
        if not self.compiled.supports(self.states.decode):
            return None
        tokens = _decode_tokens(out, prev_tokens)
        return self.compiled(tokens, out.decode_positions, self.states.decode)

    def _decode_group(self, out: SchedulerOutput, prev_tokens: mx.array | None) -> ForwardGroup:
        tokens = _decode_tokens(out, prev_tokens)
        positions = text_positions(list(out.decode_positions), 1)
        return ForwardGroup(tokens, positions, self.states.decode.layers)

    def _cohorts(self, chunks: tuple[PrefillChunk, ...]) -> list[_Cohort]:
        """Which chunks share a group. Left padding may only precede a row's first token
        (engine/cache/kv.py), so first chunks of any lengths batch together, and later
        chunks only with others of the same length (no padding)."""
        by_key: dict[object, _Cohort] = {}
        for i, chunk in enumerate(chunks):
            if chunk.length == 0:
                continue  # only vision-tower work (VisionInputs.encode ran it)
            key = "first" if chunk.start == 0 else chunk.length
            if not self.batch_prefill or chunk.snapshot_at:  # a split forward: B = 1
                key = i
            cohort = by_key.setdefault(key, _Cohort([], []))
            cohort.chunk_indices.append(i)
            cohort.row_ids.append(chunk.row_id)
        return list(by_key.values())

    def _prefill_group(
        self, chunks: tuple[PrefillChunk, ...], cohort: _Cohort, rows: dict[str, Request]
    ) -> ForwardGroup:
        """[P, L] tokens right-aligned (row p left-padded to the longest chunk)."""
        members = [chunks[i] for i in cohort.chunk_indices]
        length = max(c.length for c in members)
        pads = [length - c.length for c in members]
        ids = [
            [0] * pad + list(rows[c.row_id].prompt_ids[c.start : c.start + c.length])
            for c, pad in zip(members, pads, strict=True)
        ]
        tokens = mx.array(ids, dtype=mx.int32)
        offsets = [c.start - pad for c, pad in zip(members, pads, strict=True)]
        positions, embeds = None, None
        if self.vision is not None:
            positions = self.vision.positions(members, pads, rows)
            embeds = self.vision.embeds(tokens, members, pads, rows)
        if positions is None:
            positions = text_positions(offsets, length)
        if len(members) == 1:
            state = self.states.prefill_state(members[0].row_id)
        else:
            state = self.states.cohort_state(cohort.row_ids)
        left_pad = tuple(pads) if any(pads) else None
        split = members[0].snapshot_at if len(members) == 1 else 0
        # the runner reads a sampling chunk's last position, else only the states
        outputs = "last" if any(c.sample_row_ids for c in members) else "none"
        return ForwardGroup(tokens, positions, state.layers, left_pad, embeds, split, outputs)

    def _compiled_prompts(
        self, chunks: tuple[PrefillChunk, ...], cohort: _Cohort, rows: dict[str, Request]
    ) -> tuple[mx.array, list[BatchState]] | None:
        """A cohort of fresh text prompts' first chunks through the compiled forward: its
        [P, 1, H] last hidden states and the rows' new states (already their prefill
        states); None when the cohort must take the eager path."""
        if self.compiled_prompts is None:
            return None
        members = [chunks[i] for i in cohort.chunk_indices]
        fresh = all(
            c.start == 0 and not c.restore and not c.snapshot_at and rows[c.row_id].media is None
            for c in members
        )
        template = self.states.prefill_state(members[0].row_id)
        if not fresh or not self.compiled_prompts.applies(template, len(members)):
            return None
        prompts = [rows[c.row_id].prompt_ids[: c.length] for c in members]
        hidden, states = self.compiled_prompts(prompts, template)
        for chunk, state in zip(members, states, strict=True):
            self.states.prefill[chunk.row_id] = state
        return hidden, states

    def _scatter(self, cohort: _Cohort, group: ForwardGroup) -> list:
        """After a batched chunk: each row's state back to its own prefill state."""
        if len(cohort.row_ids) == 1:
            return group.states
        self.states.split_cohort(cohort.row_ids, group.states)
        return [layer for r in cohort.row_ids for layer in self.states.prefill[r].layers]

    @staticmethod
    def _last_prefill_hidden(
        chunks: tuple[PrefillChunk, ...], cohorts: list[_Cohort], hidden: list[mx.array]
    ) -> list[mx.array]:
        """[1, H] per sampling row of the final chunks, in chunk order (forks repeat)."""
        where = {}
        for cohort, h in zip(cohorts, hidden, strict=True):
            for p, i in enumerate(cohort.chunk_indices):
                where[i] = (h, p)
        last = []
        for i, chunk in enumerate(chunks):
            if chunk.sample_row_ids:
                h, p = where[i]
                last.append(mx.repeat(h[p : p + 1, -1], len(chunk.sample_row_ids), axis=0))
        return last


def _decode_tokens(out: SchedulerOutput, prev_tokens: mx.array | None) -> mx.array:
    """[B, 1] int32 decode inputs: known ids, or gathered lazily from the previous step."""
    known = mx.array(out.decode_token_ids, dtype=mx.int32)
    if all(src < 0 for src in out.decode_sources):
        return known[:, None]
    assert prev_tokens is not None, "pending decode input without a previous step"
    sources = mx.array([max(src, 0) for src in out.decode_sources], dtype=mx.int32)
    pending = mx.array([src >= 0 for src in out.decode_sources])
    return mx.where(pending, prev_tokens.astype(mx.int32)[sources], known)[:, None]
