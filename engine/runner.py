"""Runner: turn a SchedulerOutput into one mixed-group forward and the logits to sample."""

from __future__ import annotations

import mlx.core as mx

from engine.cache.rows import RowStates
from engine.decode import CompiledDecode
from engine.request import Request
from engine.scheduler import SchedulerOutput
from models.qwen35 import Qwen35Model
from models.state import ForwardGroup, text_positions


class ModelRunner:
    """Builds groups (the decode batch [B, 1] and one [1, C] group per prefill chunk),
    runs the model once, and returns logits [N, V] for the rows that sample. With
    `compiled` the decode batch runs through that compiled step instead of a group."""

    def __init__(
        self, model: Qwen35Model, states: RowStates, compiled: CompiledDecode | None = None
    ) -> None:
        self.model = model
        self.states = states
        self.compiled = compiled

    def execute(
        self, out: SchedulerOutput, rows: dict[str, Request], prev_tokens: mx.array | None
    ) -> mx.array | None:
        """Run the step; logits follow out.sample_row_ids (a final chunk's row repeats
        for each of its forks). None when nothing samples this step. `prev_tokens`: the
        previous step's sampled tokens [N] (possibly not computed yet), for decode rows
        whose input is still pending."""
        self.states.sync(out.decode_row_ids, out.freed_row_ids, out.forks)
        decode_logits = self._compiled_decode(out, prev_tokens)
        groups = self._groups(out, rows, prev_tokens, with_decode=decode_logits is None)
        hidden = self.model(groups) if groups else []
        last = []  # [1, H] per sampling row, in sample order
        offset = 0
        if out.decode_row_ids and decode_logits is None:
            last.append(hidden[0][:, -1])
            offset = 1
        for chunk, h in zip(out.prefill, hidden[offset:], strict=True):
            if chunk.sample_row_ids:
                last.append(mx.repeat(h[:, -1], len(chunk.sample_row_ids), axis=0))
        logits = self.model.logits(mx.concatenate(last, axis=0)) if last else None
        if decode_logits is not None:
            parts = [decode_logits] + ([logits] if logits is not None else [])
            logits = mx.concatenate(parts, axis=0) if len(parts) > 1 else decode_logits
        # Start computing now (states of every group, even chunks that sample nothing, so
        # no lazy graph carries over to the next step); the sampler's work queues behind.
        layers = [layer for g in groups for layer in g.states]
        if decode_logits is not None:
            layers += self.states.decode.layers
        pending = [a for layer in layers for a in layer.state_arrays()]
        mx.async_eval(*pending, *([logits] if logits is not None else []))
        return logits

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

    def _groups(
        self,
        out: SchedulerOutput,
        rows: dict[str, Request],
        prev_tokens: mx.array | None,
        with_decode: bool,
    ) -> list[ForwardGroup]:
        groups = []
        if out.decode_row_ids and with_decode:
            tokens = _decode_tokens(out, prev_tokens)
            positions = text_positions(list(out.decode_positions), 1)
            groups.append(ForwardGroup(tokens, positions, self.states.decode.layers))
        for chunk in out.prefill:
            req = rows[chunk.row_id]
            ids = req.prompt_ids[chunk.start : chunk.start + chunk.length]
            tokens = mx.array([ids], dtype=mx.int32)
            positions = text_positions([chunk.start], chunk.length)
            state = self.states.prefill_state(chunk.row_id)
            groups.append(ForwardGroup(tokens, positions, state.layers))
        return groups


def _decode_tokens(out: SchedulerOutput, prev_tokens: mx.array | None) -> mx.array:
    """[B, 1] int32 decode inputs: known ids, or gathered lazily from the previous step."""
    known = mx.array(out.decode_token_ids, dtype=mx.int32)
    if all(src < 0 for src in out.decode_sources):
        return known[:, None]
    assert prev_tokens is not None, "pending decode input without a previous step"
    sources = mx.array([max(src, 0) for src in out.decode_sources], dtype=mx.int32)
    pending = mx.array([src >= 0 for src in out.decode_sources])
    return mx.where(pending, prev_tokens.astype(mx.int32)[sources], known)[:, None]
