"""Runner: run a StepPlan as one mixed-group forward, sample, and read the tokens back.

The runner knows a row only through the plans: `WorkerRows` keeps what a row's NewRow
said (prompt, images, sampling parameters) and the tokens it has sampled, until a plan
frees it. Three calls per step, split so the engine can pipeline them (LLMEngine.step):
execute (the forward, queued with mx.async_eval), sample (queued behind it), read_back
(blocks; returns the StepResult). A tensor-parallel follower calls execute only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import mlx.core as mx
import numpy as np

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.rows import RowStates
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.packed_step import PackedMixedStep
from deltaserve.engine.plan import NewRow, PrefillChunk, StepPlan, StepResult, VerifiedRun
from deltaserve.engine.sampling.sampler import SampledBatch, Sampler, SamplingRow
from deltaserve.engine.shapes import cohort_splits, prompt_bucket
from deltaserve.engine.speculative import (
    Drafter,
    DraftRound,
    Verdicts,
    VerifyStep,
    store_arrays,
)
from deltaserve.engine.structured.matchers import TokenMask
from deltaserve.engine.structured.token_mask import apply_token_mask
from deltaserve.engine.types import SamplingParams
from deltaserve.engine.vision.features import VisionInputs
from deltaserve.models.qwen35 import Qwen35Model
from deltaserve.models.state import ForwardGroup, text_positions

log = logging.getLogger(__name__)


class TokenMasks(Protocol):
    """The grammar hook (RowConstraints): which tokens each sampling row may draw, and
    the tokens they drew, to advance the grammar."""

    def __len__(self) -> int: ...

    def masks(self, row_ids: Sequence[str]) -> TokenMask | None: ...

    def accept(self, row_ids: Sequence[str], tokens: Sequence[int]) -> None: ...

    def verify_masks(
        self, row_ids: Sequence[str], drafts: Sequence[Sequence[int]]
    ) -> np.ndarray | None: ...

    def accept_runs(self, runs: Sequence[tuple[str, Sequence[int]]]) -> None: ...


class WorkerRows:
    """Each live row as the plans introduced it, and the tokens it has sampled."""

    def __init__(self) -> None:
        self.rows: dict[str, NewRow] = {}
        self.output_ids: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> None:
        """Drop the plan's freed rows, then take its new ones (an id may be reused)."""
        for row_id in plan.freed_row_ids:
            self.rows.pop(row_id, None)
            self.output_ids.pop(row_id, None)
        for row in plan.new_rows:
            self.rows[row.row_id] = row
            self.output_ids[row.row_id] = []

    def sampling_rows(self, row_ids: Sequence[str]) -> list[SamplingRow]:
        """What the sampler reads of each row, with every token read back so far."""
        out = []
        for row_id in row_ids:
            row, output = self.rows[row_id], self.output_ids[row_id]
            forced = row.params.forced_token(output)
            out.append(SamplingRow(row.params, row.prompt_ids, output, row.index, forced))
        return out

    def extend(self, runs: Sequence[VerifiedRun]) -> None:
        """Record speculating rows' tokens (each run: 1 .. k + 1 of them)."""
        for run in runs:
            self.output_ids[run.row_id].extend(run.token_ids)

    def append(self, row_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """Record sampled tokens (rows freed since are skipped)."""
        for row_id, token in zip(row_ids, tokens, strict=True):
            output = self.output_ids.get(row_id)
            if output is not None:
                output.append(token)

    def clear(self) -> None:
        self.rows.clear()
        self.output_ids.clear()


@dataclass(frozen=True)
class ModelOutput:
    """A step's forward, queued: logits [N, V] (lazy) of the rows that sample, in plan
    order (a final chunk's row repeats for each of its forks). Written by execute()."""

    step: int
    row_ids: tuple[str, ...]
    logits: mx.array | None  # None when nothing samples
    verify: VerifyStep | None = None  # the speculating rows' verify group (None: none)
    # host seconds execute() spent building the graph and submitting it (mx.async_eval)
    host_split: tuple[float, float] = (0.0, 0.0)
    # the decode rows' draws, queued ahead of the prompt forward (ModelRunner's
    # draw_decode_first; None: none); row_ids and logits are then the prompt rows' alone
    first: SampledStep | None = None


@dataclass(frozen=True)
class SampledStep:
    """A step's sampled tokens, queued (lazy). Written by sample(), read by read_back()."""

    step: int
    row_ids: tuple[str, ...]
    batch: SampledBatch | None  # None when nothing sampled
    rows: tuple[SamplingRow, ...]
    verdicts: Verdicts | None = None  # the speculating rows' acceptance (None: none)


@dataclass
class _Cohort:
    """Prefill chunks that run as one left-padded [P, L] group."""

    chunk_indices: list[int]  # positions in StepPlan.prefill
    row_ids: list[str]


class ModelRunner:
    """Builds groups (the decode batch [B, 1] and the step's prefill chunks), runs the
    model once, samples the rows that sample, and reads their tokens back.

    compiled: the decode batch (and the verify batch of rows that speculate) runs through
    that compiled step instead of a group.
    batch_prefill: chunks run as few left-padded groups (cohorts) instead of one [1, C]
    group each: on the GPU a prefill forward costs its op count, not its tokens.
    compiled_prompts: cohorts of fresh text prompts' first chunks run through that
    compiled forward instead of a group.
    compile_chunks: rows' later prompt chunks (several of any lengths in one call) run
    through `compiled`'s chunk forward instead of a group (`_compiled_chunk` says when).
    """

    def __init__(
        self,
        model: Qwen35Model,
        states: RowStates,
        sampler: Sampler,
        compiled: CompiledDecode | None = None,
        batch_prefill: bool = False,
        vision: VisionInputs | None = None,
        masks: TokenMasks | None = None,
        compiled_prompts: CompiledPrefill | None = None,
        drafter: Drafter | None = None,
        compile_chunks: bool = False,
        submit_decode_first: bool = False,
        packed: PackedMixedStep | None = None,
        draw_decode_first: bool = False,
        chain_verify: bool = False,
    ) -> None:
        """vision: the image work of prompts with images (None: text only). masks: the
        grammar hook of constrained rows (None: none). drafter: speculative decoding's
        (None: no row speculates). submit_decode_first: a step with prompt work queues
        the compiled decode forward before building the prompts', and a verify step its
        draft chain before building the verify forward (EngineConfig's).
        packed: a step with decode rows and cohorts of fresh prompts runs them
        through this packed forward, whose groups share each weight's matmul, instead
        of the compiled decode and prompt forwards, which read every weight once each
        (9B on an H100: a 256-token chunk's matmuls 7.8 ms beside 16 decode rows, 1.6
        ms packed with them; engine/packed_step.py).
        draw_decode_first (EngineConfig.publish_decode_first; the engine's, whose steps
        with prompt work run in lockstep, every earlier token known): such a step with a
        compiled decode batch queues its forward and its rows' draws before the prompts'
        graphs are built (ModelOutput.first), so that those tokens can be read back while
        the prompt forward computes.
        chain_verify (EngineConfig.pipeline_verify): a verify step of the same rows may
        be built while the verify before it computes (`chains`; StepPlan.verify_chained)."""
        self.model = model
        self.states = states
        self.sampler = sampler
        self.compiled = compiled
        self.batch_prefill = batch_prefill
        self.vision = vision
        self.masks = masks
        self.rows = WorkerRows()
        self.compiled_prompts = compiled_prompts
        self.drafter = drafter
        self.compile_chunks = compile_chunks and compiled is not None
        self.submit_decode_first = submit_decode_first
        self.packed = packed
        self.draw_decode_first = draw_decode_first
        self.chain_verify = chain_verify and compiled is not None and drafter is not None
        # the last verify step's acceptance (sample writes it): a chained verify's inputs
        self._verdicts: Verdicts | None = None
        # the verify a chained one rolled back already (read_back settles it instead)
        self._chained: VerifyStep | None = None
        self._saved: list[mx.array] = []  # prefix-cache copies not yet started
        self._last_tokens: mx.array | None = None  # the last sampled step's tokens [N]
        # step -> compiled shapes it traced, until read back (a follower rank never reads
        # back: its entries stay, at most one per shape the buckets allow)
        self._traced: dict[int, int] = {}

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Queue the step's forward (mx.async_eval) and return the logits of the rows
        that sample. Decode inputs still pending (StepPlan.decode_sources) are gathered
        from the last sampled step's tokens, possibly not computed yet."""
        start = time.perf_counter()
        shapes = self._shapes_run()
        self._apply_rows(plan)
        if plan.cache_loads:
            self.states.load_prefix(plan.cache_loads)
        for chunk in plan.prefill:
            if chunk.restore:
                self.states.restore_prefix(chunk.row_id, chunk.restore)
        rows = self.rows.rows
        features = self.vision.encode(plan.prefill, rows) if self.vision is not None else []
        planned = self._cohorts(plan.prefill)
        packed = self._packed(plan, planned)
        decode_logits = packed[0] if packed is not None else self._compiled_decode(plan)
        first = None
        ahead = decode_logits is not None and bool(plan.prefill) and packed is None
        if ahead and (self.submit_decode_first or self.draw_decode_first):
            # the device computes the decode rows while the prompts' graphs are built
            mx.async_eval(decode_logits, *self.states.decode.state_arrays())
            if self.draw_decode_first:
                first = self._draw(plan.step, plan.decode_row_ids, decode_logits)
        groups = []
        if plan.decode_row_ids and decode_logits is None:
            groups.append(self._decode_group(plan))
        verify_last, verify_positions = self._verify_inputs(plan)
        verify_drafts = self._drafts(plan, verify_last)
        if verify_drafts is not None and self.submit_decode_first:
            # the device computes the drafts (and the head's store they wrote) while the
            # verify forward is built and queued behind them (the trunk's rollback was
            # queued at read-back; a chained verify's is queued with its forward)
            head = self.states.verify.draft
            mx.async_eval(*verify_drafts.arrays(), *(head.state_arrays() if head else []))
        compiled_verify = self._compiled_verify(verify_last, verify_positions, verify_drafts)
        if verify_drafts is not None and compiled_verify is None:
            assert not plan.verify_chained, "a chained verify runs compiled"
            groups.append(self._verify_group(plan, verify_last, verify_drafts))
        # cohorts run by a compiled forward (fresh prompts' first chunks, later chunks),
        # the others eagerly
        cohorts: list[_Cohort] = []
        runs: dict[int, tuple[mx.array, list[BatchState]]] = {}
        if packed is not None:  # its cohorts ran in the packed forward
            runs = dict(enumerate(packed[1]))
            cohorts = planned
        for cohort in planned if packed is None else []:
            for part, run in self._compiled_parts(plan, cohort):
                if run is not None:
                    runs[len(cohorts)] = run
                cohorts.append(part)
        eager = [c for i, c in enumerate(cohorts) if i not in runs]
        groups += [self._prefill_group(plan.prefill, c) for c in eager]
        if self.vision is not None:
            self.vision.release(plan.prefill, rows)
        hidden = self.model(groups) if groups else []
        eager_hidden = iter(hidden[len(groups) - len(eager) :])
        prefill_hidden = [
            runs[i][0] if i in runs else next(eager_hidden) for i in range(len(cohorts))
        ]
        live = len(plan.decode_row_ids)  # the decode group's rows past them are dead
        last = [hidden[0][:live, -1]] if live and decode_logits is None else []
        last += self._last_prefill_hidden(plan.prefill, cohorts, prefill_hidden)
        verify = None
        if verify_drafts is not None:
            if compiled_verify is not None:
                verified, logits_v = compiled_verify
            else:
                verified = hidden[len(groups) - len(eager) - 1]  # [B, k + 1, H]
                logits_v = self.model.logits(verified)
            verify = VerifyStep(
                plan.verify_row_ids,
                verify_drafts.tokens,
                verify_drafts.logits,
                verified,
                logits_v,
                verify_positions,
            )
        logits = self.model.logits(mx.concatenate(last, axis=0)) if last else None
        if decode_logits is not None and first is None:
            parts = [decode_logits] + ([logits] if logits is not None else [])
            logits = mx.concatenate(parts, axis=0) if len(parts) > 1 else decode_logits
        layers = [layer for g in groups[: len(groups) - len(eager)] for layer in g.states]
        if decode_logits is not None:
            layers += self.states.decode.layers
        if compiled_verify is not None:
            layers += self.states.verify.layers
        first_eager = len(groups) - len(eager)
        for j, (cohort, group) in enumerate(zip(eager, groups[first_eager:], strict=True)):
            layers += self._scatter(cohort, group)
            self._prompt_pairs(plan.prefill, cohort, group, hidden[first_eager + j])
        layers += [layer for _, states in runs.values() for s in states for layer in s.layers]
        # Start computing now (states of every group, even chunks that sample nothing, so
        # no lazy graph carries over to the next step); the sampler's work queues behind.
        pending = [a for layer in layers for a in layer.state_arrays()]
        for save in plan.cache_saves:  # after _scatter: each row's own state is current
            self._saved += self.states.save_prefix(save)
        if plan.cache_drop is not None:
            self.states.drop_prefix(plan.cache_drop)
        pending += features  # a tower pass whose tokens come in a later chunk
        if verify is not None:
            pending += [verify.logits, *_slots(self.states.verify)]
        built = time.perf_counter()
        if log.isEnabledFor(logging.DEBUG):  # what ran as which forward: its host cost
            name = "decode and prompts packed" if packed is not None else "decode"
            compiled = [(name, plan.decode_row_ids, decode_logits is not None)]
            compiled.append(("verify", plan.verify_row_ids, compiled_verify is not None))
            log.debug("step %d forwards: %s", plan.step, _forwards(compiled, groups, runs))
        mx.async_eval(*pending, *([logits] if logits is not None else []))
        split = (built - start, time.perf_counter() - built)
        if self._shapes_run() > shapes:
            self._traced[plan.step] = self._shapes_run() - shapes
        row_ids = plan.sample_row_ids
        if first is not None:
            row_ids = row_ids[len(plan.decode_row_ids) :]
        return ModelOutput(plan.step, row_ids, logits, verify, split, first)

    def _shapes_run(self) -> int:
        """How many compiled shapes (decode, verify, later chunks, fresh prompts, the
        head's draft chain, packed mixed steps) have run so far."""
        compiled = len(self.compiled.shapes) if self.compiled is not None else 0
        prompts = self.compiled_prompts
        drafts = self.drafter.compiled if self.drafter is not None else None
        compiled += len(drafts.shapes) if drafts is not None else 0
        compiled += len(self.packed.shapes) if self.packed is not None else 0
        return compiled + (len(prompts.shapes) if prompts is not None else 0)

    def _apply_rows(self, plan: StepPlan) -> None:
        """The plan's row changes, in one place: a freed row's inputs, tokens, state and
        vision features go; new rows come; forks copy; the decode batch takes its order."""
        self.rows.apply(plan)
        if self.vision is not None:
            self.vision.forget(plan.freed_row_ids)
        hold = plan.decode_rows_wait
        self.states.sync(
            plan.decode_row_ids, plan.freed_row_ids, plan.forks, hold, plan.verify_row_ids
        )
        if self.drafter is not None:
            for child, parent in plan.forks:
                self.drafter.fork(child, parent)
            # a row decoding without speculation leaves its pairs behind
            self.drafter.forget(plan.freed_row_ids + plan.decode_row_ids)

    def sample(self, output: ModelOutput) -> SampledStep:
        """Queue one draw per sampling row, under its grammar's mask. Called once the
        previous step is read back: seeds, penalties, forced tokens and masks see every
        earlier token whether or not steps are pipelined. The masks are computed while the
        device runs the forward (queued by execute)."""
        verdicts = None
        if output.verify is not None:
            assert self.drafter is not None, "a verify step without a drafter"
            verify_rows = self.rows.sampling_rows(output.verify.row_ids)
            verify = self._processed(output.verify, verify_rows)
            verdicts = self.drafter.accept(verify, verify_rows)
            mx.async_eval(*verdicts.arrays())
            self._verdicts = verdicts
        # the step's tokens in plan order (a later pipelined step's pending inputs)
        first = output.first.batch if output.first is not None else None
        tokens = [first.tokens] if first is not None else []
        if output.logits is None:
            self._last_tokens = tokens[0] if tokens else None
            return SampledStep(output.step, (), None, (), verdicts)
        drawn = self._draw(output.step, output.row_ids, output.logits)
        assert drawn.batch is not None
        tokens.append(drawn.batch.tokens)
        self._last_tokens = mx.concatenate(tokens) if len(tokens) > 1 else tokens[0]
        return replace(drawn, verdicts=verdicts)

    def _draw(self, step: int, row_ids: tuple[str, ...], logits: mx.array) -> SampledStep:
        """One draw per row of `logits` under its grammar's mask, queued."""
        rows = self.rows.sampling_rows(row_ids)
        masks = self.masks
        mask = masks.masks(row_ids) if masks is not None and len(masks) else None
        batch = self.sampler.sample(logits, rows, mask.bits if mask is not None else None)
        mx.async_eval(*batch.arrays())
        return SampledStep(step, row_ids, batch, tuple(rows))

    def _processed(self, verify: VerifyStep, rows: list[SamplingRow]) -> VerifyStep:
        """The verify logits as the sampler would see them at each column, column j with
        the row's first j drafts as output: under the grammar's mask after those drafts
        (RowConstraints.verify_masks), then logit_bias and penalties. So acceptance and
        logprobs are the processed distribution's, as without speculation. Reads the
        drafts back (they are computed ahead of the verify forward queued behind them);
        unchanged when no row is constrained or asks for processing."""
        constrained = self.masks is not None and len(self.masks) > 0
        processes = any(_processes(r.params) for r in rows)
        if not constrained and not processes:
            return verify
        b, columns, vocab = verify.logits.shape
        drafts = verify.drafts.tolist()
        bits = None
        if constrained:
            assert self.masks is not None
            bits = self.masks.verify_masks(verify.row_ids, drafts)
        if bits is None and not processes:
            return verify
        flat = verify.logits.reshape(b * columns, vocab)
        if bits is not None:
            flat = apply_token_mask(flat, bits.reshape(b * columns, -1))
        if processes:
            expanded = [
                SamplingRow(r.params, r.prompt_ids, [*r.output_ids, *d[:j]], r.choice)
                for r, d in zip(rows, drafts, strict=True)
                for j in range(columns)
            ]
            flat = self.sampler.process(flat, expanded)
        return replace(verify, logits=flat.reshape(b, columns, vocab))

    def read_back(self, sampled: SampledStep, last: bool = True) -> StepResult:
        """Wait for a step's tokens, record them (rows, grammar), and start the step's
        prefix-cache copies (flush_saves). last=False: the part of a step read back
        ahead of the rest (ModelOutput.first); its traces and copies wait for the rest."""
        runs = self._read_verdicts(sampled.verdicts)
        traced = self._traced.pop(sampled.step, 0) if last else 0
        if sampled.batch is None:
            if last:
                self.flush_saves()
            return StepResult(sampled.step, verified=runs, traced=traced)
        tokens, logprobs = sampled.batch.to_python(sampled.rows)
        self.rows.append(sampled.row_ids, tokens)
        if self.masks is not None:
            self.masks.accept(sampled.row_ids, tokens)
        if self.drafter is not None:
            self.drafter.sampled(sampled.row_ids, tokens)
        if last:
            self.flush_saves()
        return StepResult(
            sampled.step, sampled.row_ids, tuple(tokens), tuple(logprobs), runs, traced
        )

    def _read_verdicts(self, verdicts: Verdicts | None) -> tuple[VerifiedRun, ...]:
        """The speculating rows' tokens; their states keep only what they accepted."""
        if verdicts is None:
            return ()
        assert self.drafter is not None, "verdicts without a drafter"
        rows = self.rows.sampling_rows(verdicts.step.row_ids)
        chained = self._chained is verdicts.step
        runs = self.drafter.read_back(verdicts, self.states.verify, rows, chained)
        self.rows.extend(runs)
        if self.masks is not None and len(self.masks):
            self.masks.accept_runs([(run.row_id, run.token_ids) for run in runs])
        if chained:  # the chained verify computing now holds the rolled-back states
            self._chained = None
        else:
            mx.async_eval(*store_arrays(self.states.verify))
        return tuple(runs)

    def flush_saves(self) -> None:
        """Start computing the prefix-cache copies of the steps run so far: once a step's
        tokens are read back, so the copies run while the next step is planned and built,
        not ahead of the step's sampled tokens (a long prompt's snapshot is hundreds of
        small copies, in the step that samples its first token). The arrays are values of
        the states as saved, whenever they are computed."""
        if self._saved:
            mx.async_eval(*self._saved)
            self._saved = []
        if self.states.prefix is not None:  # the disk tier's copies, one flush behind
            self.states.prefix.write_back()

    def reset(self) -> None:
        """After a failed step: every row, state and pending copy goes (the prefix cache
        is reset with the states)."""
        self._saved = []
        self._last_tokens = None
        self._verdicts = self._chained = None
        self._traced.clear()
        self.rows.clear()
        self.states.reset()
        if self.drafter is not None:
            self.drafter.clear()
        if self.vision is not None:
            self.vision.clear()

    def _compiled_decode(self, plan: StepPlan) -> mx.array | None:
        """Logits [B, V] of the decode batch through the compiled step, or None when it
        does not apply (no decode rows, compiling off, or a store kind it lacks)."""
        if not plan.decode_row_ids or self.compiled is None:
            return None
        if not self.compiled.supports(self.states.decode):
            return None
        tokens = _decode_tokens(plan, self._last_tokens)
        return self.compiled(tokens, plan.decode_positions, self.states.decode)

    def _packed(
        self, plan: StepPlan, cohorts: list[_Cohort]
    ) -> tuple[mx.array, list[tuple[mx.array, list[BatchState]]]] | None:
        """The decode batch and the step's prompt work through the packed forward
        (`packed`): the decode rows' logits and each cohort's run, as the compiled decode
        step and `_compiled_prompts` would give them; None where it does not apply (no
        decode rows, a verify batch, or prompt work other than cohorts of fresh text
        prompts' first chunks that the compiled prompt forward takes). Unlike that
        forward's, a shape not traced yet is traced here under load: a new set of shapes
        traces three layers, not the model (warm-up traces the common ones)."""
        if self.packed is None or not plan.decode_row_ids or plan.verify_row_ids:
            return None
        if not cohorts or sum(len(c.chunk_indices) for c in cohorts) != len(plan.prefill):
            return None  # a chunk with only tower work (in no cohort)
        members = [[plan.prefill[i] for i in c.chunk_indices] for c in cohorts]
        if not all(self._fresh(m) for m in members):
            return None
        rows = self.rows.rows
        template = self.states.prefill_state(members[0][0].row_id)
        most = max(len(m) for m in members)
        if not self.packed.supports(self.states.decode, template, most):
            return None
        tokens = _decode_tokens(plan, self._last_tokens)
        blocks = [[rows[c.row_id].prompt_ids[: c.length] for c in m] for m in members]
        logits, runs = self.packed(
            tokens, plan.decode_positions, self.states.decode, blocks, template
        )
        for chunks, (_, states) in zip(members, runs, strict=True):
            for chunk, state in zip(chunks, states, strict=True):
                self.states.prefill[chunk.row_id] = state
        return logits, runs

    def _decode_group(self, plan: StepPlan) -> ForwardGroup:
        """The decode batch as an eager group: tokens [B, 1] for its B rows, the dead
        rows that hold it at its bucket (RowStates) after the live ones on token 0 at
        position 0 (their outputs are never read)."""
        tokens = _decode_tokens(plan, self._last_tokens)
        offsets = list(plan.decode_positions)
        dead = self.states.decode.num_rows - tokens.shape[0]
        if dead > 0:
            tokens = mx.concatenate([tokens, mx.zeros((dead, 1), tokens.dtype)])
            offsets += [0] * dead
        return ForwardGroup(tokens, text_positions(offsets, 1), self.states.decode.layers)

    @property
    def chain_source(self) -> Verdicts | None:
        """While a chained verify is built, the acceptance of the verify it follows (not
        read back: its rows' tokens are the host's plus what this keeps); else None."""
        return self._verdicts if self._chained is not None else None

    def chains(self, plan: StepPlan) -> bool:
        """Whether a verify step may be chained onto `plan`, a verify step, while it
        computes (StepPlan.verify_chained): chain_verify is on, `plan` has no prompt work,
        its verify batch runs through the compiled verify and draft chain (greedy rows
        over stores that have traced forms), and nothing reads a row's tokens to build
        the next step (no grammar, logit_bias or penalties: their masks and processing
        are computed from the tokens on the host). Its plain decode rows decode on, from
        its sampled tokens, as in any pipelined step."""
        if not (self.chain_verify and plan.verify_row_ids) or plan.prefill:
            return False
        assert self.compiled is not None and self.drafter is not None
        state = self.states.verify
        if self.drafter.compiled is None or state.draft is None or state.draft.arrays is None:
            return False
        if not self.compiled.supports(state) or self.masks is not None and len(self.masks):
            return False
        params = [self.rows.rows[r].params for r in plan.verify_row_ids]
        return all(p.is_greedy and not _processes(p) for p in params)

    def _verify_inputs(self, plan: StepPlan) -> tuple[mx.array | None, tuple[int, ...] | mx.array]:
        """The verify batch's last tokens [B] and first positions (None, (): no row
        speculates). A chained verify's come from the acceptance of the verify before
        it, still computing: each row's last kept token and its position, lazily; that
        verify's rollback is queued here too (BatchState.keep_verified_pending), and
        read_back settles it."""
        if not plan.verify_row_ids:
            return None, ()
        if not plan.verify_chained:
            return mx.array(plan.verify_token_ids, dtype=mx.int32), plan.verify_positions
        before = self._verdicts
        assert before is not None and before.step.row_ids == plan.verify_row_ids, (
            "a chained verify follows a verify of the same rows"
        )
        state, k = self.states.verify, plan.num_draft
        accepted = before.num_accepted
        dead = state.num_rows - len(plan.verify_row_ids)
        kept = accepted + 1
        if dead:  # a bucketed batch's dead rows keep one column
            kept = mx.concatenate([kept, mx.ones((dead,), kept.dtype)])
        state.keep_verified_pending(kept.astype(mx.int32), k + 1)
        self._chained = before.step
        last = mx.take_along_axis(before.tokens, accepted[:, None], axis=1)[:, 0]
        first = before.step.positions
        first = first if isinstance(first, mx.array) else mx.array(first, dtype=mx.int32)
        return last.astype(mx.int32), (first + kept[: len(plan.verify_row_ids)]).astype(mx.int32)

    def _drafts(self, plan: StepPlan, last: mx.array | None) -> DraftRound | None:
        """The verify batch's drafts (None: no row speculates) from its rows' last tokens
        `last` [B]. Their earlier tokens are all read back (a verify step follows a
        read-back step, or is chained onto a verify of greedy rows), so their noise keys
        are."""
        if last is None:
            return None
        assert self.drafter is not None and plan.num_draft == self.drafter.num_draft
        rows = self.rows.sampling_rows(plan.verify_row_ids)
        return self.drafter.draft(plan.verify_row_ids, self.states.verify, last, rows)

    def _compiled_verify(
        self,
        last: mx.array | None,
        positions: tuple[int, ...] | mx.array,
        drafts: DraftRound | None,
    ) -> tuple[mx.array, mx.array] | None:
        """The verify batch's hidden [B, k + 1, H] and logits through the compiled verify
        (CompiledDecode.verify), or None when it does not apply (no row speculates,
        compiling off, or a store kind it lacks): the verify then runs as a group."""
        if last is None or drafts is None or self.compiled is None:
            return None
        if not self.compiled.supports(self.states.verify):
            return None
        tokens = _verify_tokens(last, drafts)
        return self.compiled.verify(tokens, positions, self.states.verify)

    def _verify_group(self, plan: StepPlan, last: mx.array, drafts: DraftRound) -> ForwardGroup:
        """[B, k + 1]: each speculating row's last token and its drafts, unpadded, with
        DeltaNet state kept after every column (BatchState.keep_verified picks one)."""
        state = self.states.verify
        assert state.num_rows == len(plan.verify_row_ids), "dead rows only when compiled"
        positions = text_positions(list(plan.verify_positions), plan.num_draft + 1)
        tokens = _verify_tokens(last, drafts)
        return ForwardGroup(tokens, positions, state.layers, state_slots=True)

    def _prompt_pairs(
        self,
        chunks: tuple[PrefillChunk, ...],
        cohort: _Cohort,
        group: ForwardGroup,
        hidden: mx.array,
    ) -> None:
        """After an eager prompt chunk (hidden [P, L, H]): the speculating rows' pairs go
        into the MTP head (Drafter.prompt_pairs)."""
        if self.drafter is None:
            return
        rows = self.rows.rows
        for p, i in enumerate(cohort.chunk_indices):
            chunk = chunks[i]
            row = rows[chunk.row_id]
            if not row.speculative:
                continue
            pad = group.shape[1] - chunk.length
            end = chunk.start + chunk.length
            next_ids = row.prompt_ids[chunk.start + 1 : end + 1]
            self.drafter.prompt_pairs(
                self.states.prefill[chunk.row_id],
                hidden[p, pad:],
                group.positions[:, p, pad:],
                next_ids,
                chunk.sample_row_ids,
            )

    def _cohorts(self, chunks: tuple[PrefillChunk, ...]) -> list[_Cohort]:
        """Which chunks share a group. Left padding may only precede a row's first token
        in an eager group (engine/cache/kv.py), so first chunks of any lengths batch
        together, and later chunks only with others of the same length (no padding),
        except those the compiled chunk forward may take (`_chunk_compiles`): they form
        one cohort whatever their lengths (its padding joins each row's left pad), split
        again if it declines (`_compiled_parts`). First chunks that take the
        compiled forward split into the buckets it runs (`cohort_splits`)."""
        by_key: dict[object, _Cohort] = {}
        rows = self.rows.rows
        for i, chunk in enumerate(chunks):
            if chunk.length == 0:
                continue  # only vision-tower work (VisionInputs.encode ran it)
            key: object = "first" if chunk.start == 0 else chunk.length
            if self.compile_chunks and self._chunk_compiles(chunk, rows[chunk.row_id]):
                key = "later"
            if not self.batch_prefill or chunk.snapshot_at:  # a split forward: B = 1
                key = i
            cohort = by_key.setdefault(key, _Cohort([], []))
            cohort.chunk_indices.append(i)
            cohort.row_ids.append(chunk.row_id)
        cohorts = []
        for key, cohort in by_key.items():
            members = [chunks[i] for i in cohort.chunk_indices]
            if key != "first" or self.compiled_prompts is None or not self._fresh(members):
                cohorts.append(cohort)
                continue
            # fresh prompts: as many compiled calls as keep each bucket within its area
            lengths = [c.length for c in members]
            for group in cohort_splits(lengths, self.compiled_prompts.max_area):
                indices = [cohort.chunk_indices[j] for j in group]
                cohorts.append(_Cohort(indices, [chunks[i].row_id for i in indices]))
        return cohorts

    def _compiled_parts(
        self, plan: StepPlan, cohort: _Cohort
    ) -> list[tuple[_Cohort, tuple[mx.array, list[BatchState]] | None]]:
        """The cohort through a compiled forward where one takes it: [(cohort, its run)],
        or [(cohort, None)] for the eager path. Later chunks of several rows whose shape
        the chunk forward declines (not traced yet) try it row by row (a row's own shape
        may be traced: warm-up traces some), and the rest run eagerly, split by length
        (an eager group pads only before a row's first token)."""
        chunks, rows = plan.prefill, self.rows.rows
        run = self._compiled_prompts(plan, cohort)
        if run is None:
            run = self._compiled_chunk(plan, cohort)
        members = [chunks[i] for i in cohort.chunk_indices]
        several_later = (
            self.compile_chunks
            and len(members) > 1
            and all(self._chunk_compiles(c, rows[c.row_id]) for c in members)
        )
        if run is not None or not several_later:
            return [(cohort, run)]
        parts: list[tuple[_Cohort, tuple[mx.array, list[BatchState]] | None]] = []
        by_length: dict[int, _Cohort] = {}
        for i in cohort.chunk_indices:
            single = _Cohort([i], [chunks[i].row_id])
            run = self._compiled_chunk(plan, single)
            if run is not None:
                parts.append((single, run))
                continue
            part = by_length.setdefault(chunks[i].length, _Cohort([], []))
            part.chunk_indices.append(i)
            part.row_ids.append(chunks[i].row_id)
        return parts + [(part, None) for part in by_length.values()]

    def _prefill_group(self, chunks: tuple[PrefillChunk, ...], cohort: _Cohort) -> ForwardGroup:
        """[P, L] tokens right-aligned (row p left-padded to the longest chunk)."""
        members = [chunks[i] for i in cohort.chunk_indices]
        length = max(c.length for c in members)
        pads = [length - c.length for c in members]
        rows = self.rows.rows
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
        # the runner reads a sampling chunk's last position, else only the states; the MTP
        # head reads every position of a speculating row's chunk
        outputs = "last" if any(c.sample_row_ids for c in members) else "none"
        if any(rows[c.row_id].speculative for c in members):
            outputs = "all"
        return ForwardGroup(tokens, positions, state.layers, left_pad, embeds, split, outputs)

    def _compiled_prompts(
        self, plan: StepPlan, cohort: _Cohort
    ) -> tuple[mx.array, list[BatchState]] | None:
        """A cohort of fresh text prompts' first chunks through the compiled forward: its
        [P, 1, H] last hidden states and the rows' new states (already their prefill
        states); None when the cohort must take the eager path, a bucket not traced yet
        included unless the step may trace (`_may_trace`)."""
        if self.compiled_prompts is None:
            return None
        members, rows = [plan.prefill[i] for i in cohort.chunk_indices], self.rows.rows
        template = self.states.prefill_state(members[0].row_id)
        if not self._fresh(members) or not self.compiled_prompts.applies(template, len(members)):
            return None
        prompts = [rows[c.row_id].prompt_ids[: c.length] for c in members]
        bucket = prompt_bucket(len(prompts), max(len(p) for p in prompts))
        if bucket not in self.compiled_prompts.shapes and not self._may_trace(plan):
            return None
        hidden, states = self.compiled_prompts(prompts, template)
        for chunk, state in zip(members, states, strict=True):
            self.states.prefill[chunk.row_id] = state
        return hidden, states

    @staticmethod
    def _may_trace(plan: StepPlan) -> bool:
        """Whether this step may trace a prompt shape warm-up left out: only a step of one
        prompt chunk and no row streaming (none decodes, verifies or waits out the step),
        whose trace delays that one request. Anywhere
        else a trace stalls every stream and every waiting prompt while the eager forward
        costs a few ms more (H100, 0.8B, a fresh machine's kernel cache: traces of 3-18 s;
        two were 36 s of a 16-client phase's 40), and a shape first met under load seldom
        recurs often enough to repay it."""
        streaming = plan.decode_row_ids or plan.verify_row_ids or plan.decode_rows_wait
        return not streaming and len(plan.prefill) == 1

    def _compiled_chunk(
        self, plan: StepPlan, cohort: _Cohort
    ) -> tuple[mx.array, list[BatchState]] | None:
        """Rows' later prompt chunks through the compiled chunk forward
        (CompiledDecode.chunk), one row or several of any lengths: their [P, 1, H] last
        hidden states and the rows' states, updated (several rows run as one cohort
        state, split back afterwards). None (the eager path) for compile_chunks off,
        chunks it does not take (`_chunk_compiles`), a store kind without a traced form,
        and a shape not traced yet where the step may not trace (`_may_trace`); warm-up
        traces the common shapes."""
        if not self.compile_chunks:
            return None
        assert self.compiled is not None
        members, rows = [plan.prefill[i] for i in cohort.chunk_indices], self.rows.rows
        if not all(self._chunk_compiles(c, rows[c.row_id]) for c in members):
            return None
        states = [self.states.prefill_state(c.row_id) for c in members]
        if not self.compiled.supports(states[0]):
            return None  # one engine's rows share their store kinds
        lengths = [c.length for c in members]
        shape = self.compiled.chunk_shape(lengths, self.compiled.kv_columns(states))
        if shape not in self.compiled.shapes and not self._may_trace(plan):
            return None
        ids = [rows[c.row_id].prompt_ids[c.start : c.start + c.length] for c in members]
        starts = [c.start for c in members]
        if len(members) == 1:
            return self.compiled.chunk(ids, starts, states[0]), states
        state = self.states.cohort_state(cohort.row_ids)
        hidden = self.compiled.chunk(ids, starts, state)
        self.states.split_cohort(cohort.row_ids, state.layers)
        return hidden, [self.states.prefill[r] for r in cohort.row_ids]

    @staticmethod
    def _chunk_compiles(chunk: PrefillChunk, row: NewRow) -> bool:
        """Whether the compiled chunk forward takes this chunk: a later chunk of a text
        row that does not speculate (the MTP head reads every position), without a split
        for a prefix-cache snapshot."""
        return bool(chunk.start and not chunk.snapshot_at) and (
            row.media is None and not row.speculative
        )

    def _fresh(self, members: list[PrefillChunk]) -> bool:
        """Whether these chunks are fresh text prompts' first chunks, whole (the compiled
        forward's inputs)."""
        rows = self.rows.rows
        return all(
            c.start == 0
            and not c.restore
            and not c.snapshot_at
            and rows[c.row_id].media is None
            and not rows[c.row_id].speculative  # the head needs every position's hidden
            for c in members
        )

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


def _forwards(
    compiled: list[tuple[str, tuple[str, ...], bool]],
    groups: list[ForwardGroup],
    runs: dict[int, tuple[mx.array, list[BatchState]]],
) -> str:
    """The step's forwards for the debug log: the decode and verify batches (compiled or
    a group of the eager forward), each compiled prompt run ([P, 1, H] out) and each group
    of the eager forward by shape. On a GPU a forward's host cost is its op count, about
    the same whatever its tokens, so the count of forwards is most of a step's cost."""
    parts = [f"{name} {len(rows)} compiled" for name, rows, done in compiled if rows and done]
    parts += [f"prompt run {len(states)} rows" for _, states in runs.values()]
    parts += [f"eager {g.shape[0]}x{g.shape[1]}" for g in groups]
    return ", ".join(parts) or "none"


def _decode_tokens(plan: StepPlan, prev_tokens: mx.array | None) -> mx.array:
    """[B, 1] int32 decode inputs: known ids, or gathered lazily from the previous step."""
    known = mx.array(plan.decode_token_ids, dtype=mx.int32)
    if all(src < 0 for src in plan.decode_sources):
        return known[:, None]
    assert prev_tokens is not None, "pending decode input without a previous step"
    sources = mx.array([max(src, 0) for src in plan.decode_sources], dtype=mx.int32)
    pending = mx.array([src >= 0 for src in plan.decode_sources])
    return mx.where(pending, prev_tokens.astype(mx.int32)[sources], known)[:, None]


def _verify_tokens(last: mx.array, drafts: DraftRound) -> mx.array:
    """[B, k + 1] int32: each speculating row's last token, then its drafts."""
    return mx.concatenate([last[:, None], drafts.tokens], axis=1)


def _processes(params: SamplingParams) -> bool:
    """Whether the sampler processes this row's logits (logit_bias or a penalty)."""
    penalties = params.repetition_penalty != 1.0 or params.presence_penalty
    return bool(penalties or params.frequency_penalty or params.logit_bias)


def _slots(state: BatchState) -> list[mx.array]:
    """The DeltaNet states a verify forward kept after each column."""
    slots = [getattr(layer, "slots", None) for layer in state.layers]
    return [a for pair in slots if pair is not None for a in pair]
