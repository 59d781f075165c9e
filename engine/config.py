"""Engine settings: the `engine:` section of config.yaml, frozen and validated once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DISTRIBUTED_BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")
CPU_TOKENS = 512  # the CPU's per-step token budget and chunk size (EngineConfig.for_device)
GPU_TOKENS = 2048  # a GPU's where the chunk cost was not measured (tensor parallel)


@dataclass(frozen=True)
class KVCacheConfig:
    """KV store of the full-attention layers.

    kind: "fp" (as computed), "affine" (MLX affine `bits`/`group_size`), or "turboquant"
    (rotated Lloyd-Max codes, `key_bits`/`value_bits`). The first `start` tokens of each
    row stay in full precision; later ones are quantized.
    """

    kind: str = "fp"
    bits: int = 8
    group_size: int = 64
    key_bits: int = 8
    value_bits: int = 3
    start: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("fp", "affine", "turboquant"):
            raise ValueError(f"kv_cache.kind must be fp, affine or turboquant, not {self.kind!r}")
        if self.kind == "affine" and self.bits not in (4, 8):
            raise ValueError("kv_cache.bits must be 4 or 8 for affine KV")
        if self.group_size not in (32, 64, 128):
            raise ValueError("kv_cache.group_size must be 32, 64 or 128")
        for name in ("key_bits", "value_bits"):
            if not 1 <= getattr(self, name) <= 8:
                raise ValueError(f"kv_cache.{name} must be in [1, 8]")
        if self.start < 0:
            raise ValueError("kv_cache.start must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and memory policy of the engine."""

    max_num_seqs: int = 32  # rows running at once
    # Per-step token budget (decode rows + prefill chunks); 0 = 512 on the CPU, on a GPU
    # sized from what a prompt chunk costs, measured at start (engine/scheduling/chunk_cost.py)
    max_num_batched_tokens: int = 0
    # Longest prefill chunk of one request in one step; 0 = 512 on the CPU, on a GPU sized
    # from what a prompt chunk costs, measured at start
    max_prefill_chunk: int = 0
    max_waiting: int = 256  # queued requests before new ones get 429
    memory_budget_bytes: int = 0  # row state (KV + DeltaNet); 0 = derive from free memory
    # MLX's cache of freed GPU buffers, capped (kernels/platform.py); unset: 4 GiB on CUDA
    # (MLX's own cap is its memory limit, and freed buffers of a server's ever new step
    # shapes filled an H100 until steps failed), MLX's on Metal; 0 = MLX's. The CPU keeps
    # freed buffers in glibc instead (kernels/cpu/host_memory.py)
    buffer_cache_bytes: int | None = None
    # MLX's CUDA graphs (MLX_USE_CUDA_GRAPHS, read by MLX at its first GPU evaluation, so
    # set before the model loads: kernels/platform.py prepare_device). Unset: off, unless
    # the variable is set (a server's ever new step make-ups miss MLX's graph cache and
    # instantiate new graphs: an H100 serving 0.8B to 64 clients, 3,214 -> 3,899 tok/s and
    # p99 gap 65.8 -> 28.6 ms with them off). CUDA only
    cuda_graphs: bool | None = None
    max_context: int = 0  # 0 = the model's max_position_embeddings
    # Norms, projections and MLP over all groups' tokens at once (each weight read once a
    # step); unset: on for CPU (a small prompt group next to the decode rows cost a second
    # pass over the weights: 0.8B, 8 rows + 2 tokens 0.99 -> 0.75 s), off on Metal/CUDA.
    # On a GPU it runs a step with decode rows and fresh prompts as one packed forward,
    # each layer a compiled call (engine/packed_step.py), instead of the compiled decode and
    # prompt forwards, which read every weight once each (~6 ms of an H100's 9B mixed step).
    # Not yet measured on a GPU: its eager predecessor saved that device time and spent ~5
    # ms more host time, no faster over HTTP (bench/README.md)
    pack_token_wise: bool | None = None
    # Step N+1 is planned and queued (mx.async_eval) before step N's tokens are read back,
    # overlapping Python's graph building with the device. Unset: on for Metal/CUDA; off on
    # the CPU, where the two share the cores (small shape, 32 rows: 72 vs 74 ms a step) and
    # a request that arrives mid-step waited for the step already queued behind it
    pipeline_steps: bool | None = None  # plan step N+1 before N is read back; unset = GPU only
    # With pipeline_steps, a speculative verify step of the same greedy rows is built and
    # queued while the verify before it computes, its rows' last tokens, positions and
    # rollback taken lazily from that verify's acceptance (engine/speculative.py); off, a
    # verify step runs in lockstep: its acceptance is read back before the next step is
    # planned. Unset: on for Metal/CUDA (with pipeline_steps), off on the CPU
    pipeline_verify: bool | None = None
    # In a step with prompt work, the compiled decode batch's forward is queued
    # (mx.async_eval) before the prompts' graphs are built, so the device computes it
    # while Python builds them: such a step runs in lockstep, and its prompt forwards'
    # building and submission are the largest of any step's. A speculative verify step
    # likewise queues its rows' draft chain before building the verify forward (in
    # lockstep, or chained onto the verify computing: pipeline_verify). Unset: on for
    # Metal/CUDA
    submit_decode_first: bool | None = None
    # In such a step the compiled decode rows' tokens are also drawn before the prompts'
    # graphs are built, and read back and handed to their streams once the prompt forward
    # is queued, while it computes (with compile_decode; it queues the decode forward
    # first by itself). Unset: off on every device: on an H100 at 9B it made the streams'
    # p99 gap and the mixed steps longer, not shorter (bench/README.md)
    publish_decode_first: bool | None = None
    # After handing a step's tokens to the server's event loop, the engine thread waits
    # (at most 2 ms) until the loop has written them to the streams, before it builds the
    # next step (engine/streaming.py hand_off): the two share one GIL, and the next step's
    # graph building would otherwise hold it while the chunks wait (with --engine-process
    # they share none, and nothing waits). Unset: off on every device (an H100 at 9B:
    # the streams' p99 gap stayed 3.0-3.35x their p50 with it, 3.2-3.25x without)
    stream_handoff: bool | None = None
    # Decode step as one mx.compile'd call (engine/decode.py); unset: on for Metal/CUDA
    # (launch-bound), off on CPU (no measured win: tiny B=16 206 vs 201 tok/s)
    compile_decode: bool | None = None
    # Fresh text prompts' first chunk as one mx.compile'd forward per bucketed shape
    # (engine/compiled_prefill.py); unset: on for Metal/CUDA, where an eager prompt forward
    # costs its op count whatever its length; off on CPU, where it costs its arithmetic
    compile_prompt: bool | None = None
    # A prompt's later chunks (a prompt longer than a chunk, the rest of one after a
    # prefix-cache hit) as one mx.compile'd forward per bucketed shape (engine/decode.py
    # CompiledDecode.chunk; with compile_decode); unset: on for Metal/CUDA, off on CPU, as
    # compile_prompt
    compile_chunks: bool | None = None
    # Seconds the engine may spend at start tracing the compiled paths' common shapes
    # (engine/warmup.py), so the first busy minute does not; unset: 60 on Metal/CUDA, 0 on
    # CPU (nothing compiled there by default)
    warm_up_seconds: float | None = None
    # Prefill chunks of several prompts as one left-padded group; unset: on for Metal/CUDA
    # (op-bound there), off on CPU (padding costs FLOPs there)
    batch_prefill: bool | None = None
    # DeltaNet's prompt-chunk core as one mx.compile'd call (models/deltanet.py); unset: on
    # for Metal/CUDA (op-bound), off on CPU (an op costs its arithmetic; tracing only adds)
    compile_prefill: bool | None = None
    # The fused kernels (kernels/platform.py): unset = on where the device has one, each
    # off = its plain-MLX reference. The Metal sources are untested on a Mac so far.
    # Prompt chunks' DeltaNet recurrence as one scan kernel per layer (CUDA only:
    # kernels/gated_delta_scan.py) instead of the chunked form's many small kernels
    deltanet_scan: bool | None = None
    # A DeltaNet layer's prompt chunk as three kernels around that scan (CUDA only:
    # kernels/deltanet_chunk.py) instead of ~45 compiled ops, each a node MLX encodes
    fused_deltanet_chunk: bool | None = None
    # A DeltaNet layer's decode token as one kernel (CUDA/Metal: kernels/deltanet_decode.py),
    # and a speculative verify's k + 1 tokens as its many-column form (one kernel on CUDA)
    fused_deltanet_decode: bool | None = None
    # RMSNorm of half-precision activations as one kernel (CUDA/Metal: kernels/rms_norm.py)
    fused_rms_norm: bool | None = None
    # The gated-delta decode step as one kernel (CUDA/Metal: kernels/gated_delta_fused.py)
    fused_gated_delta_step: bool | None = None
    # Latency bound: while rows decode, a step's prefill is sized (from measured step
    # times) to take at most this factor x a decode-only step; 0 or unset = token budget only
    max_stall_factor: float | None = 2.0
    # Prefix cache (engine/prefix_cache/index.py)
    prefix_cache: bool = True  # resume prompts from the cached state of an earlier prefix
    prefix_cache_bytes: int = 0  # cap on cached state; 0 = half of the row-state budget
    prefix_block_tokens: int = 64  # tokens per cached KV block
    # No snapshot before this many prompt tokens: taking one splits the prefill there (one
    # more forward), which a short prefix does not repay
    prefix_min_tokens: int = 512
    # Disk tier (engine/prefix_cache/disk.py): every cached block and snapshot is also
    # written to this directory, which a restarted server reads; "" = memory only
    prefix_cache_dir: str = ""
    prefix_cache_disk_gib: float = 16.0  # the directory's bound; least recently used go first
    # A constraint (JSON schema, forced tool calls) whose grammar takes longer than this
    # to compile is refused with a 400 (engine/structured/grammar.py)
    grammar_timeout_s: float = 5.0
    # Tensor parallel, when started on several processes by mlx.launch (README "Several
    # GPUs or Macs"): the mx.distributed backend to join; any = the one launched
    distributed_backend: str = "any"
    # A rank that waits this long on the others (one died or hangs) ends with an error
    distributed_timeout_s: float = 60.0
    # Speculative decoding (engine/speculative.py): "mtp" drafts num_speculative_tokens
    # tokens per decoding row with the checkpoint's MTP head and verifies them in the
    # row's next step; None = off. Greedy output is unchanged token for token.
    speculative: str | None = None
    num_speculative_tokens: int = 2  # drafts per speculating row and step (1-3)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one per row)")
        if self.max_num_batched_tokens < 0 or self.max_prefill_chunk < 0:
            raise ValueError("max_num_batched_tokens and max_prefill_chunk must be >= 0")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.memory_budget_bytes < 0 or self.max_context < 0:
            raise ValueError("memory_budget_bytes and max_context must be >= 0")
        if self.buffer_cache_bytes is not None and self.buffer_cache_bytes < 0:
            raise ValueError("buffer_cache_bytes must be >= 0 (0 = MLX's own cap)")
        if self.prefix_cache_bytes < 0 or self.prefix_block_tokens < 1:
            raise ValueError("prefix_cache_bytes must be >= 0 and prefix_block_tokens >= 1")
        if self.prefix_min_tokens < 1:
            raise ValueError("prefix_min_tokens must be >= 1")
        if not self.prefix_cache_disk_gib > 0:
            raise ValueError("prefix_cache_disk_gib must be > 0")
        if not self.grammar_timeout_s > 0:
            raise ValueError("grammar_timeout_s must be > 0")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"distributed_backend must be one of {DISTRIBUTED_BACKENDS}")
        if not self.distributed_timeout_s > 0:
            raise ValueError("distributed_timeout_s must be > 0")
        if self.speculative not in (None, "mtp"):
            raise ValueError(f"speculative must be mtp or unset, not {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 3:
            raise ValueError("num_speculative_tokens must be in [1, 3]")
        if self.max_stall_factor and self.max_stall_factor <= 1:
            raise ValueError("max_stall_factor must be > 1 (or 0 / unset: no latency bound)")

    def for_device(self, gpu: bool, measured: int = 0) -> EngineConfig:
        """This config with the token budget and chunk size that were left at 0 filled in
        for the device: `measured` (engine/scheduling/chunk_cost.py's budget_tokens, from what a
        chunk costs on this device), else GPU_TOKENS or CPU_TOKENS. A GPU's chunk costs
        mostly a fixed part, so the CPU's 512 would cut a GPU's prompts into pieces that
        each pay it."""
        chunk = self.max_prefill_chunk or measured or (GPU_TOKENS if gpu else CPU_TOKENS)
        budget = self.max_num_batched_tokens or max(chunk, self.max_num_seqs)
        return replace(self, max_num_batched_tokens=budget, max_prefill_chunk=chunk)
