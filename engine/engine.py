"""The synchronous engine: one step = schedule -> execute -> update.

Used directly for offline generation (benchmarks, tests) and driven by the engine thread
of AsyncEngine for serving. Not thread-safe: exactly one thread calls into it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import mlx.core as mx

from deltaserve.engine.api import HOST_PARTS, EngineSummary
from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.budget import MemoryBudget, StateCosts, default_budget_bytes
from deltaserve.engine.cache.factory import (
    kv_bytes_per_element_pair,
    kv_prefix_tokens,
    kv_store_factory,
)
from deltaserve.engine.cache.kv import COMPACT_PAD
from deltaserve.engine.cache.rows import RowStates
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.packed_step import PackedMixedStep
from deltaserve.engine.parallel.step_leader import StepLeader
from deltaserve.engine.plan import StepPlan, StepResult
from deltaserve.engine.prefix_cache.disk import PrefixDisk, checkpoint_identity
from deltaserve.engine.prefix_cache.index import PrefixIndex
from deltaserve.engine.request import row_id_of
from deltaserve.engine.runner import ModelOutput, ModelRunner, SampledStep
from deltaserve.engine.sampling.sampler import Sampler
from deltaserve.engine.scheduling.chunk_cost import measure_chunk_cost
from deltaserve.engine.scheduling.scheduler import Scheduler
from deltaserve.engine.scheduling.speculation import Speculation
from deltaserve.engine.shapes import decode_bucket
from deltaserve.engine.speculative import Drafter
from deltaserve.engine.structured.grammar import GrammarCompiler, grammar_compiler
from deltaserve.engine.structured.matchers import RowConstraints
from deltaserve.engine.types import GenerationRequest, RequestOutput, SamplingParams, TokenLogprob
from deltaserve.engine.vision.features import VisionInputs
from deltaserve.engine.vision.media import prepare_media
from deltaserve.engine.warmup import warm_up
from deltaserve.kernels.platform import Platform, resolve_platform, start_platform
from deltaserve.models.build import LoadedModel

log = logging.getLogger(__name__)
TYPICAL_CHAT_TOKENS = 4096  # prompt + answer of a typical chat turn (the start-up summary)
WARM_UP_GPU_SECONDS = 60.0  # EngineConfig.warm_up_seconds unset on Metal/CUDA (engine/warmup.py)


@dataclass
class _InFlight:
    """A step whose forward and sampling are queued but not read back yet."""

    plan: StepPlan
    sampled: SampledStep


@dataclass
class Completion:
    """Offline result of one choice."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def _platform(config: EngineConfig, loaded: LoadedModel, leader: StepLeader | None) -> Platform:
    """The profile this engine runs with: the device's and the config's switches, less the
    paths this engine cannot take (steps in lockstep with tensor-parallel ranks, whose
    followers draw no tokens; no compiled decode over kv_cache.start's full-precision
    prefix)."""
    dtype = str(loaded.dtype).removeprefix("mlx.core.")
    profile = resolve_platform(config, dtype)
    if leader is not None:
        profile = replace(profile, pipeline_steps=False)
    elif loaded.parallel is not None:  # a follower rank: rank 0 samples, it never reads back
        profile = replace(profile, publish_decode_first=False)
    kv = config.kv_cache
    if profile.compile_decode and kv.kind != "fp" and kv.start:  # PrefixKV (kv_store_factory)
        log.warning("compiled decode is off: kv_cache.start > 0 has no compiled form")
        profile = replace(profile, compile_decode=False)
    return profile


class LLMEngine:
    """Owns the scheduler, the row states, the runner and the sampler."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        leader: StepLeader | None = None,
    ) -> None:
        """`clock` times the steps (the scheduler's cost model learns from it). `leader`:
        this is rank 0 of a tensor-parallel group (engine/parallel/tensor_parallel.py); each step's
        plan goes to the other ranks first, and steps are not pipelined."""
        self.loaded = loaded
        self.leader = leader
        config = config or EngineConfig()
        # Every layer reads the fast paths in force from here on (kernels/platform.py)
        self.platform = _platform(config, loaded, leader)
        start_platform(self.platform)
        gpu = not self.platform.is_cpu
        # On a GPU, what a prompt chunk costs (engine/scheduling/chunk_cost.py); not with tensor
        # parallelism, where a forward needs every rank
        self.compiled_prompts = (
            CompiledPrefill(loaded.model) if self.platform.compile_prompt else None
        )
        compiled = self._compiled_decode()
        chunks = compiled if compiled is not None and self.platform.compile_chunks else None
        loaded.model.pack_token_wise = self.platform.pack_token_wise
        # A GPU's mixed step of decode rows and fresh prompts runs packed where both run
        # compiled (engine/packed_step.py); the CPU's (pack_token_wise on, compiled paths
        # off) packs its eager groups anyway, and its tests run the compiled paths beside
        # decoding rows as a GPU without packing does
        packs = gpu and self.platform.pack_token_wise and loaded.parallel is None
        packed = None
        if packs and compiled is not None and self.compiled_prompts is not None:
            packed = PackedMixedStep(loaded.model)
        self.chunk_cost = None
        if gpu and leader is None and loaded.parallel is None:
            pair = (compiled, packed) if compiled is not None and packed is not None else None
            self.chunk_cost = measure_chunk_cost(loaded, self.compiled_prompts, pair)
        measured = self.chunk_cost.budget_tokens() if self.chunk_cost is not None else 0
        self.config = config.for_device(gpu, measured)
        if self.compiled_prompts is not None:  # its calls hold at most a chunk's tokens
            self.compiled_prompts.max_area = self.config.max_prefill_chunk
        self.pipeline = self.platform.pipeline_steps
        cfg = loaded.config
        self.max_context = self.config.max_context or cfg.max_position_embeddings
        dtype_size = loaded.dtype.size
        kv = self.config.kv_cache
        pair = kv_bytes_per_element_pair(kv, dtype_size, cfg.head_dim)
        costs = StateCosts.for_model(cfg, pair, dtype_size, kv_prefix_tokens(kv))
        # a compiled decode step holds the batch at bucket sizes: the budget counts dead rows
        held = partial(decode_bucket, max_rows=self.config.max_num_seqs) if compiled else None
        self.speculation = self._speculation()
        # verify steps chained onto the one computing (the runner's compiled verify); they
        # leave each row's rejected drafts as padding until it is settled (KVStore.settle)
        chains = self.pipeline and self.platform.pipeline_verify and compiled is not None
        pad = COMPACT_PAD + self.speculation.num_draft + 1 if self.speculation and chains else 0
        self.budget = MemoryBudget(self._budget_bytes(), costs, held, pad)
        self._log_budget()
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.prefix_cache = self._prefix_index()
        self.constraints = RowConstraints(self.grammar_compiler(), cfg.vocab_size, self.eos_ids)
        # An eager DeltaNet prefill keeps a snapshot's state mid-chunk at the cost of one
        # more core call; compiled, the snapshot ends the chunk (the compiled call stays one)
        in_chunk = not self.platform.compile_prefill
        self.scheduler = Scheduler(
            self.config,
            self.budget,
            self.max_context,
            clock,
            self.prefix_cache,
            self.chunk_cost,
            snapshot_in_chunk=in_chunk,
            on_release=(self.constraints.release,),  # a row's matcher goes with it
            speculation=self.speculation,
            compiled_chunks=chunks is not None,
            pipelined=self.pipeline,
        )
        kv_factory = kv_store_factory(self.config.kv_cache)
        # A compiled step retraces per batch size: hold the decode batch at bucket sizes.
        max_rows = self.config.max_num_seqs
        bucket = partial(decode_bucket, max_rows=max_rows) if compiled else None
        cached = self.prefix_cache is not None
        disk = self.prefix_cache.disk if self.prefix_cache is not None else None
        drafts = self.speculation is not None  # every row state carries the head's store
        new_state = partial(BatchState.empty, cfg, kv_factory, draft=drafts)
        self.states = RowStates(new_state, bucket, cached, disk)
        batch_prefill = self.platform.batch_prefill
        vision = VisionInputs(loaded.model, loaded.vision, loaded.dtype)
        # in lockstep the step's tokens are read back at once: no graph needs them lazily
        sampler = Sampler(lazy_tokens=self.pipeline)
        drafter = None
        if self.speculation is not None and loaded.mtp is not None:
            num_draft, compiled_draft = self.speculation.num_draft, compiled is not None
            drafter = Drafter(loaded.model, loaded.mtp, num_draft, compiled_draft)
            log.info("speculative decoding: the MTP head drafts %d tokens per row; verify and "
                     "greedy drafts %s (compile_decode)", num_draft,
                     "compiled" if compiled_draft else "eager")  # fmt: skip
        self.runner = ModelRunner(
            loaded.model, self.states, sampler, compiled, batch_prefill, vision,
            self.constraints, self.compiled_prompts, drafter, chunks is not None,
            self.platform.submit_decode_first, packed, self.platform.publish_decode_first,
            chains,
        )  # fmt: skip
        warm = self.config.warm_up_seconds
        warm = (WARM_UP_GPU_SECONDS if gpu else 0.0) if warm is None else warm
        if warm > 0 and leader is None and loaded.parallel is None:
            new_state = partial(BatchState.empty, cfg, kv_factory)
            chunk = self.config.max_prefill_chunk
            columns = drafter.num_draft + 1 if drafter is not None else 0
            warm_up(
                new_state, self.compiled_prompts, compiled, chunk, max_rows, warm, columns,
                chunks is not None, (sampler, cfg.vocab_size),
                drafter.compiled if drafter is not None else None, packed,
            )  # fmt: skip
        self._inflight: _InFlight | None = None
        self._waited = 0.0  # seconds this step() call blocked on read-backs
        self._parts = dict.fromkeys(HOST_PARTS, 0.0)  # its host time by part

    def _speculation(self) -> Speculation | None:
        """Speculative decoding's policy when config.speculative asks for it and the
        checkpoint has an MTP head (else a warning, and decoding as usual); refused with
        tensor parallelism, whose followers would need the drafts."""
        if self.config.speculative is None:
            return None
        if self.leader is not None or self.loaded.parallel is not None:
            raise ValueError(
                "speculative decoding does not run with tensor parallelism yet: "
                "leave speculative unset"
            )
        if self.loaded.mtp is None:
            log.warning("speculative=mtp: %s has no MTP head; decoding without speculation",
                        self.loaded.path)  # fmt: skip
            return None
        return Speculation(self.config.num_speculative_tokens)

    def _budget_bytes(self) -> int:
        if self.config.memory_budget_bytes:
            return self.config.memory_budget_bytes
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        info = dict(mx.device_info())
        weights = self.loaded.weight_bytes() + self.loaded.vision_weight_bytes()
        parallel = self.loaded.parallel
        cpu = self.platform.is_cpu
        if parallel is not None and cpu:  # ranks may share this host's memory
            host //= parallel.size
        return default_budget_bytes(info, host, weights, cpu)

    def _compiled_decode(self) -> CompiledDecode | None:
        return CompiledDecode(self.loaded.model) if self.platform.compile_decode else None

    def _prefix_index(self) -> PrefixIndex | None:
        cfg = self.config
        if not cfg.prefix_cache:
            return None
        if cfg.kv_cache.kind != "fp" and cfg.kv_cache.start:
            log.warning("prefix cache is off: it cannot store kv_cache.start's prefix part")
            return None
        costs, block = self.budget.costs, cfg.prefix_block_tokens
        max_bytes = cfg.prefix_cache_bytes or self.budget.total // 2
        log.debug("prefix cache: up to %.2f GiB, %d-token blocks", max_bytes / 2**30, block)
        return PrefixIndex(
            block,
            costs.kv_bytes_per_token,
            costs.ssm_bytes_per_row,
            max_bytes,
            self.budget,
            cfg.prefix_min_tokens,
            self._prefix_disk(),
        )

    def _prefix_disk(self) -> PrefixDisk | None:
        """The prefix cache's disk tier, under a directory of this checkpoint, dtype and
        KV store (None: not configured, or unusable)."""
        cfg = self.config
        if not cfg.prefix_cache_dir:
            return None
        if self.leader is not None or self.loaded.parallel is not None:
            log.warning("prefix cache disk tier is off: not with tensor parallelism")
            return None
        settings = f"{cfg.kv_cache!r};block={cfg.prefix_block_tokens}"
        identity = checkpoint_identity(self.loaded.path, str(self.loaded.dtype), settings)
        max_bytes = int(cfg.prefix_cache_disk_gib * 2**30)
        return PrefixDisk.open(cfg.prefix_cache_dir, identity, max_bytes)

    def summary(self, chat_tokens: int = TYPICAL_CHAT_TOKENS) -> EngineSummary:
        """The engine's set-up in a user's terms (see EngineSummary)."""
        cache, chat_tokens = self.prefix_cache, min(chat_tokens, self.max_context)
        return EngineSummary(
            platform=self.platform,
            weight_bytes=self.loaded.weight_bytes() + self.loaded.vision_weight_bytes(),
            budget_bytes=self.budget.total,
            reserved_bytes=self.budget.reserved + self.budget.padding,
            max_num_seqs=self.config.max_num_seqs,
            max_context=self.max_context,
            chat_tokens=chat_tokens,
            chat_rows=self.budget.rows_of(chat_tokens),
            context_rows=self.budget.rows_of(self.max_context),
            prefix_cache_bytes=cache.max_bytes if cache is not None else 0,
        )

    def _log_budget(self) -> None:
        row = self.budget.row_bytes(self.max_context)
        if self.chunk_cost is not None:
            log.info(
                "a prompt chunk costs %.1f ms + %.3f ms a token here%s, a later chunk of a "
                "prompt %.1f ms + the same (measured at start)",
                1e3 * self.chunk_cost.fixed_seconds,
                1e3 * self.chunk_cost.token_seconds,
                " beside decoding rows (packed with them)" if self.chunk_cost.beside_decode else "",
                1e3 * self.chunk_cost.later_fixed_seconds,
            )
        log.info(
            "steps: up to %d tokens, prompt chunks up to %d tokens, %d rows",
            self.config.max_num_batched_tokens,
            self.config.max_prefill_chunk,
            self.config.max_num_seqs,
        )
        log.debug(
            "row-state budget up to %.2f GiB: %d rows of the full %d-token context (%.1f MiB each)",
            self.budget.total / 2**30,
            self.budget.total // row,
            self.max_context,
            row / 2**20,
        )

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request (raises InvalidRequestError / QueueFullError)."""
        media = prepare_media(request, self.loaded.config, self.loaded.vision_config)
        compiled = self.constraints.compile(request.params.constraint)
        self.scheduler.add(request, self.eos_ids, media)
        if compiled is not None:
            row_ids = [row_id_of(request.request_id, i) for i in range(request.n)]
            self.constraints.add(row_ids, compiled, request.params)

    def grammar_compiler(self) -> GrammarCompiler:
        """The process's grammar compiler for this model, registered for the server
        (deltaserve.engine.structured.grammar.find_compiler), which compiles off this
        thread; a compile past config.grammar_timeout_s is refused."""
        cfg = self.loaded.config
        eos = tuple(cfg.eos_token_ids)
        timeout = self.config.grammar_timeout_s
        return grammar_compiler(self.loaded.path, cfg.vocab_size, eos, timeout)

    def abort(self, request_id: str) -> list[RequestOutput]:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # -- the step -------------------------------------------------------------------------
    def step(
        self, publish: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """Run one engine step, schedule -> execute -> update, and return its deltas. A
        step that overlaps the next (_overlaps) is read back in the next call instead.
        The call's own time, less its waits on the device, is the step's host time
        (StepTimes.host_seconds, by HOST_PARTS in host_parts; a pipelined call also
        applies the step before).

        publish: takes the deltas of the step in flight as soon as they are read back
        when this call then runs a step in lockstep (a prompt chunk beside decode rows),
        so that those tokens reach their streams before the step's forward is built and
        computed, not with its own tokens: a stream's gap would otherwise be the two steps
        together, on a GPU most of the streams' p99 gap. With publish_decode_first (the
        platform's), such a step's own decode rows' tokens follow once its prompt forward
        is queued, while that computes. Without `publish` they are returned with the
        step's other deltas."""
        start, self._waited = time.perf_counter(), 0.0
        self._parts = dict.fromkeys(HOST_PARTS, 0.0)
        with self._guard():
            plan, early = self._schedule(publish)
            if self.leader is not None:
                self.leader.publish(plan)
            if self._overlaps(plan):
                deltas = early + self._pipelined(plan)
            else:
                deltas = early + self._lockstep(plan, publish)
        if not plan.is_empty:
            host = time.perf_counter() - start - self._waited
            self.scheduler.step_times.observe_host(plan.kind, host, self._parts)
            if log.isEnabledFor(logging.DEBUG):
                self._log_host(plan, host)
        return deltas

    def _log_host(self, plan: StepPlan, host: float) -> None:
        """Debug: where this call's host time went, what it waited on the device, and
        MLX's memory after it (a step's first use of a buffer size allocates; the buffer
        cache shrinking means buffers were freed back to the device), so a slow step in
        the log says which it was."""
        parts = " / ".join(f"{1e3 * self._parts[p]:.1f}" for p in HOST_PARTS)
        log.debug(
            "step %d host %.1f ms (%s: %s), waited %.1f ms; MLX active %.0f MiB, cache %.0f MiB",
            plan.step, 1e3 * host, " / ".join(HOST_PARTS), parts, 1e3 * self._waited,
            mx.get_active_memory() / 2**20, mx.get_cache_memory() / 2**20,
        )  # fmt: skip

    def _schedule(
        self, publish: Callable[[list[RequestOutput]], None] | None
    ) -> tuple[StepPlan, list[RequestOutput]]:
        """The next plan, and the deltas read back before it was made. A verify step in
        flight (one the runner can chain onto: `_overlaps`) has the next verify step
        chained onto it where the scheduler allows (Scheduler.chained_plan); otherwise
        it is read back first (its deltas to `publish`, else returned), so the plan
        knows what it accepted."""
        inflight, deltas, start = self._inflight, [], time.perf_counter()
        if inflight is not None and inflight.plan.verify_row_ids:
            chained = self.scheduler.chained_plan()
            if chained is not None:
                self._parts["schedule"] = time.perf_counter() - start
                return chained, []
            deltas = self._drain()
            if publish is not None and deltas:
                publish(deltas)
                deltas = []
            start = time.perf_counter()
        plan = self.scheduler.schedule()
        self._parts["schedule"] += time.perf_counter() - start
        return plan, deltas

    def _lockstep(
        self, plan: StepPlan, publish: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """Run `plan` and read its tokens back before returning; the step still in flight
        comes first, its deltas handed to `publish` (see step) or returned with these, and
        so do the decode rows' deltas drawn ahead of a prompt forward (ModelOutput.first)."""
        deltas = self._drain()
        if publish is not None and deltas and not plan.is_empty:
            publish(deltas)
            deltas = []
        output = self._execute(plan)
        if plan.is_empty:  # it only frees rows
            return deltas
        if output.first is not None:  # the decode rows' tokens, while the prompts compute
            first = self._update(plan, self._read_back(output.first, last=False), first=True)
            if publish is not None and first:
                publish(first)
            else:
                deltas += first
        return deltas + self._update(plan, self._read_back(self._sample(output)))

    def _execute(self, plan: StepPlan) -> ModelOutput:
        """The runner's execute, its graph building and submission counted apart."""
        output = self.runner.execute(plan)
        self.scheduler.submitted(plan)
        build, submit = output.host_split
        self._parts["build"] += build
        self._parts["submit"] += submit
        return output

    def _sample(self, output: ModelOutput) -> SampledStep:
        """The runner's sample (queued, not read back), its host time counted."""
        start = time.perf_counter()
        sampled = self.runner.sample(output)
        self._parts["sample"] += time.perf_counter() - start
        return sampled

    def _read_back(self, sampled: SampledStep, last: bool = True) -> StepResult:
        """The runner's read-back (blocks until the step is computed), its wait counted."""
        start = time.perf_counter()
        result = self.runner.read_back(sampled, last)
        self._waited += time.perf_counter() - start
        return result

    def _update(
        self, plan: StepPlan, result: StepResult, first: bool = False
    ) -> list[RequestOutput]:
        """The scheduler's update with a step's tokens, its host time counted. first: the
        decode rows' tokens read back ahead of the rest (ModelOutput.first)."""
        start = time.perf_counter()
        if first:
            deltas = self.scheduler.update_first(result)
        else:
            deltas = self.scheduler.update(plan, result)
        self._parts["update"] += time.perf_counter() - start
        return deltas

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        """With tensor parallelism, a step's collectives and read-back wait on the other
        ranks: a hung rank ends the group instead of hanging it."""
        if self.leader is None:
            return contextlib.nullcontext()
        return self.leader.watchdog.guard("a step's collectives")

    def _overlaps(self, plan: StepPlan) -> bool:
        """Whether `plan` runs pipelined (config.pipeline_steps). A step with prompt work
        next to decoding rows runs in lockstep, and so does one that samples a prompt's
        first token: its tokens are read back now, not after the next step's graph is
        built (and a max_tokens=1 row then plans no wasted step). Pipelined, such steps
        measured no faster on a GPU and their first tokens came a step's building later
        (bench/README.md, 43e410d); the decode rows' forward is queued first instead
        (submit_decode_first)."""
        first = any(c.sample_row_ids for c in plan.prefill)
        if plan.verify_chained:  # built on the step in flight, which it has rolled back
            return True
        # a row that may draft next needs its token (plan.read_back), and a speculating
        # row's next step its acceptance (and a fresh row's drafts), unless a verify may
        # be chained onto it (pipeline_verify; else the next call reads it back first)
        if plan.read_back:
            return False
        if plan.verify_row_ids:
            return self.pipeline and self.runner.chains(plan)
        return self.pipeline and not (plan.prefill and (plan.decode_row_ids or first))

    def _pipelined(self, plan: StepPlan) -> list[RequestOutput]:
        """Step N's forward is queued (mx.async_eval) before step N-1's tokens are read
        back, so Python's scheduling and graph building overlap the device; decode rows
        take their input from N-1's lazy sampled tokens. N samples after N-1's update, so
        seeds, penalties and grammar masks see every earlier token. A row that finished
        at N-1 computes one discarded token at N."""
        output = self._execute(plan)
        deltas = self._drain()  # N-1 read back while N computes
        if not plan.is_empty:
            self._inflight = _InFlight(plan, self._sample(output))
        return deltas

    def _drain(self) -> list[RequestOutput]:
        """Read back the step in flight (blocks until computed) and apply its tokens."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        return self._update(inflight.plan, self._read_back(inflight.sampled))

    def fail_all(self, error: str) -> list[RequestOutput]:
        """A step raised: every request ends with the error; states start over."""
        self._inflight = None
        self.runner.reset()
        if self.leader is not None:
            self.leader.fail(error)
        return self.scheduler.fail_all(error)

    def release_cached_buffers(self) -> None:
        """After a failed step (not a device fault, after which the device takes no call):
        MLX's cache of freed buffers, which now holds the rows' states too, goes back to
        the device, so that a step that failed for want of memory (CUDA: cudaMallocAsync
        out of memory) is not followed by others failing for the same cache."""
        mx.clear_cache()

    def idle(self) -> None:
        """Called while there is no work: rank 0 of a tensor-parallel group heartbeats."""
        if self.leader is not None:
            self.leader.heartbeat()

    def close(self) -> None:
        """At shutdown (after every request ended): what is still queued finishes (the
        prefix-cache copies flushed after the last read-back), so no MLX work outlives
        the thread that queued it, and the other ranks stop following. (The server's
        "terminate called without an active exception" at exit had another cause: see
        AsyncEngine.shutdown.)"""
        mx.synchronize()
        store = self.states.prefix
        if store is not None and store.disk is not None:  # every save, then the index
            store.write_back(all_saved=True)
            store.disk.close()
        if self.leader is not None:
            self.leader.stop()

    # -- offline API ------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion (n = 1 each); results in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        results = [Completion() for _ in prompts]
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self.add_request(GenerationRequest(f"gen-{i}", tuple(prompt), p))
        while self.has_work():
            for delta in self.step():
                result = results[int(delta.request_id.split("-")[1])]
                result.token_ids.extend(delta.token_ids)
                result.logprobs.extend(delta.logprobs or ())
                result.finish_reason = delta.finish_reason or result.finish_reason
        mx.synchronize()  # nothing queued (prefix-cache copies) outlives the call: see close
        return results
