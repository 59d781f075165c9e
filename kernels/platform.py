"""The platform profile: what this process computes on and which fast paths are on.

Resolved once at start by `resolve_platform` from the device and the engine config's
switches (an explicit True/False beats the device's default), made current by
`start_platform`, and read by every layer through `current_platform()` instead of probing
the device: kernels pick their kernel or their plain-MLX reference, models their compiled
or eager forms, the engine its step shape. Before the engine starts one (a kernel test, the
loader), `current_platform()` is the device's defaults.

A fused kernel exists for some devices only (FUSED_KERNEL_DEVICES); switched on elsewhere it
stays off, with a warning. The Linux CPU set-up (OpenBLAS, the sgemv shim, malloc tuning)
lives in kernels/cpu/; `start_platform` runs its post-load half.

Imports nothing from server/, engine/ or models/, and mlx only when probing the device or
starting the platform, so the server's formatting code can import the profile type.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Protocol

from deltaserve.kernels import cpu

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "metal")
# The devices each fused kernel has a source for (CUDA and Metal; the CPU runs the plain-MLX
# reference behind the same function). The Metal sources are untested here (no Mac).
FUSED_KERNEL_DEVICES = {
    "deltanet_scan": ("cuda",),  # kernels/gated_delta_scan.py
    "fused_deltanet_chunk": ("cuda",),  # kernels/deltanet_chunk.py (with deltanet_scan)
    "fused_deltanet_decode": ("cuda", "metal"),  # kernels/deltanet_decode.py
    "fused_rms_norm": ("cuda", "metal"),  # kernels/rms_norm.py
    "fused_gated_delta_step": ("cuda", "metal"),  # kernels/gated_delta_fused.py
}
# MLX's cache of freed buffers on CUDA, capped: MLX's own cap is its memory limit, and a
# server's steps meet ever new shapes (prompt chunks of every length next to any number of
# rows), whose freed buffers a later step of another size cannot reuse. Uncapped, an H100
# serving the 9B shape filled with them until steps failed (out of memory, or an illegal
# memory access reported by cudaGraphInstantiate); capped, none did (bench/README.md).
CUDA_BUFFER_CACHE_BYTES = 4 << 30
# Step shapes whose default is on for a GPU (launch- or op-bound) and off on the CPU
GPU_DEFAULT_ON = (
    "compile_decode",
    "compile_prompt",
    "compile_chunks",
    "compile_prefill",
    "batch_prefill",
    "pipeline_steps",
    "pipeline_verify",
    "submit_decode_first",
)
# Step shapes whose default is off on every device: a mixed step's decode rows' tokens
# read back while its prompt forward computes made an H100's mixed steps and the
# streams' longest gaps longer at 9B (bench/README.md); the engine thread waiting for the
# event loop to write a step's tokens left an H100's p99 gap at 9B where it was (both:
# bench/README.md)
DEFAULT_OFF = ("publish_decode_first", "stream_handoff")


class PlatformSwitches(Protocol):
    """The engine config's switches (engine/config.py EngineConfig); None = the device's
    default."""

    compile_decode: bool | None
    compile_prompt: bool | None
    compile_chunks: bool | None
    compile_prefill: bool | None
    batch_prefill: bool | None
    pipeline_steps: bool | None
    pipeline_verify: bool | None
    submit_decode_first: bool | None
    publish_decode_first: bool | None
    stream_handoff: bool | None
    pack_token_wise: bool | None
    deltanet_scan: bool | None
    fused_deltanet_chunk: bool | None
    fused_deltanet_decode: bool | None
    fused_rms_norm: bool | None
    fused_gated_delta_step: bool | None
    buffer_cache_bytes: int | None  # MLX's cache of freed GPU buffers; None = the device's
    cuda_graphs: bool | None  # MLX's CUDA graphs; None = off (prepare_device)


@dataclass(frozen=True)
class Platform:
    """Where MLX computes and which compiled paths and kernels are on. Frozen at start."""

    device: str  # "cpu", "cuda" or "metal"
    device_name: str = ""  # mx.device_info()'s, e.g. "NVIDIA H200" ("" if it has none)
    dtype: str = ""  # compute dtype of the weights, e.g. "float32" ("" before loading)
    mlx_version: str = ""
    blas: str = ""  # the BLAS behind the CPU's matmuls ("" off the CPU)
    # Compiled paths and step shapes (engine/config.py says what each does)
    compile_decode: bool = False  # the decode step as one mx.compile'd call
    compile_prompt: bool = False  # fresh prompts' first chunk as one mx.compile'd call
    compile_chunks: bool = False  # a prompt's later chunks as one mx.compile'd call
    compile_prefill: bool = False  # DeltaNet's prompt-chunk core compiled
    batch_prefill: bool = False  # prompt chunks of several requests as one padded group
    pipeline_steps: bool = False  # step N+1 queued before step N is read back
    pipeline_verify: bool = False  # and a verify step chained onto the one computing
    submit_decode_first: bool = False  # a mixed step's decode forward (a verify's drafts) first
    publish_decode_first: bool = False  # and its decode rows' tokens read back first
    stream_handoff: bool = False  # the engine thread waits for a step's tokens to be written
    pack_token_wise: bool = False  # token-wise layers over all groups' tokens at once
    # Kernels: on = the fused kernel, off = its plain-MLX reference behind the same function
    deltanet_scan: bool = False
    fused_deltanet_chunk: bool = False
    fused_deltanet_decode: bool = False
    fused_rms_norm: bool = False
    fused_gated_delta_step: bool = False
    # MLX's cache of freed buffers on a GPU, capped at start (mx.set_cache_limit); 0 = MLX's
    # own cap. The CPU's freed buffers are kept by glibc instead (kernels/cpu/host_memory.py)
    buffer_cache_bytes: int = 0
    # MLX records a CUDA step's kernels into CUDA graphs (MLX_USE_CUDA_GRAPHS), set before
    # MLX's first GPU evaluation by `prepare_device`; False off CUDA
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        assert self.device in DEVICES, f"device must be one of {DEVICES}, not {self.device!r}"
        assert not (self.buffer_cache_bytes and self.is_cpu), "buffer_cache_bytes on the CPU"
        for name, devices in FUSED_KERNEL_DEVICES.items():
            assert not getattr(self, name) or self.device in devices, f"{name} on {self.device}"

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    def switches(self) -> dict[str, bool]:
        """Each compiled path and kernel, on or off."""
        names = (*GPU_DEFAULT_ON, *DEFAULT_OFF, "pack_token_wise", *FUSED_KERNEL_DEVICES)
        return {name: getattr(self, name) for name in names}

    def describe(self) -> str:
        """The profile in one line, for the start-up log."""
        name = f" ({self.device_name})" if self.device_name else ""
        mlx = f", mlx {self.mlx_version}" if self.mlx_version else ""
        head = f"platform: {self.device}{name}, {self.dtype or '?'}{mlx}"
        blas = f"; BLAS: {self.blas}" if self.blas else ""
        cache = self.buffer_cache_bytes
        kept = f"; freed buffers kept: up to {cache / 2**30:.1f} GiB" if cache else ""
        graphs = ""
        if self.device == "cuda":
            graphs = f"; CUDA graphs {'on' if self.cuda_graphs else 'off'}"
        on = [name for name, enabled in self.switches().items() if enabled] or ["none"]
        off = [name for name, enabled in self.switches().items() if not enabled] or ["none"]
        return f"{head}{blas}{kept}{graphs}; on: {', '.join(on)}; off: {', '.join(off)}"


def resolve_platform(
    switches: PlatformSwitches | None = None, dtype: str = "", device: str | None = None
) -> Platform:
    """The profile for `device` (None: MLX's default device) under the config's `switches`
    (None: all at the device's default). Explicit True/False wins, except that a kernel
    the device has no source for stays off (logged)."""
    name, version = "", ""
    if device is None:
        device, name, version = _probe()
    gpu = device != "cpu"
    values: dict[str, bool] = {name: gpu for name in GPU_DEFAULT_ON}
    values.update(dict.fromkeys(DEFAULT_OFF, False))
    values["pack_token_wise"] = not gpu
    values.update({k: device in devices for k, devices in FUSED_KERNEL_DEVICES.items()})
    for key in values:
        chosen = getattr(switches, key, None)
        if chosen is None:
            continue
        if chosen and device not in FUSED_KERNEL_DEVICES.get(key, DEVICES):
            log.warning("%s is on in the config but has no %s kernel: it stays off", key, device)
            continue
        values[key] = chosen
    blas = cpu.blas_in_use() if device == "cpu" else ""
    cache = getattr(switches, "buffer_cache_bytes", None)
    if cache is None:
        cache = CUDA_BUFFER_CACHE_BYTES if device == "cuda" else 0
    elif cache and device == "cpu":
        log.warning("buffer_cache_bytes is for a GPU: the CPU keeps freed buffers in glibc")
        cache = 0
    graphs = device == "cuda" and mlx_cuda_graphs()
    return Platform(
        device, name, dtype, version, blas, **values, buffer_cache_bytes=cache, cuda_graphs=graphs
    )


# MLX on CUDA records each step's kernels into CUDA graphs of MLX_MAX_OPS_PER_BUFFER ops,
# each looked up by its topology in a cache (MLX_CUDA_GRAPH_CACHE_SIZE) and instantiated on a
# miss. A server's steps are ever new make-ups (rows joining, prompt chunks of any number
# and length beside the decode rows): a mixed step's extra ops shift every cut after them,
# so its graphs miss and instantiate. Off, kernels launch one by one. Measured on an H100
# (bench/README.md, 0.8B over HTTP): off, 64 clients 3,214 -> 3,899 tok/s, the streams'
# p99 gap 65.8 -> 28.6 ms, mixed steps 22.6 -> 14.5 ms; in-process B = 64 4,450 -> 7,465
# tok/s. A larger cache or larger graphs were slower still.
CUDA_GRAPHS_VARIABLE = "MLX_USE_CUDA_GRAPHS"


def prepare_device(switches: PlatformSwitches | None) -> None:
    """The settings MLX reads once, at its first evaluation on the GPU: call before the
    model loads. CUDA graphs (the config's cuda_graphs; unset: off, unless
    MLX_USE_CUDA_GRAPHS is already in the environment, which then stands). Harmless off
    CUDA (MLX reads the variable only there); too late once MLX has evaluated on the GPU,
    which `resolve_platform` cannot see (it reports the variable)."""
    import os

    chosen = getattr(switches, "cuda_graphs", None)
    if chosen is not None:
        os.environ[CUDA_GRAPHS_VARIABLE] = "1" if chosen else "0"
    else:
        os.environ.setdefault(CUDA_GRAPHS_VARIABLE, "0")


def mlx_cuda_graphs() -> bool:
    """Whether MLX uses CUDA graphs by the environment: its default is on, and it reads
    the variable as C's atoi does (so "false" is 0, off)."""
    import os

    value = os.environ.get(CUDA_GRAPHS_VARIABLE)
    if value is None:
        return True
    digits = re.match(r"\s*[+-]?\d+", value)
    return digits is not None and int(digits.group()) != 0


def _probe() -> tuple[str, str, str]:
    """(device, device name, mlx version) of MLX's default device: the one device probe."""
    import mlx.core as mx

    name = str(dict(mx.device_info()).get("device_name", ""))
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu", name, mx.__version__
    if mx.cuda.is_available():
        return "cuda", name, mx.__version__
    assert mx.metal.is_available(), "the default device is a GPU but neither CUDA nor Metal"
    return "metal", name, mx.__version__


_current: Platform | None = None


def current_platform() -> Platform:
    """The profile in force: `start_platform`'s, else the device's defaults (resolved on
    first use; code that changes MLX's default device later calls `use_platform(None)`)."""
    global _current
    if _current is None:
        _current = resolve_platform()
    return _current


def use_platform(profile: Platform | None) -> None:
    """Make `profile` current (None: back to the device's defaults, resolved on next use).
    No process set-up: tests swap profiles with it."""
    global _current
    _current = profile


def start_platform(profile: Platform) -> None:
    """Make `profile` current and finish the process set-up that needs the model loaded:
    on the CPU, freed buffers kept for the next step (kernels/cpu, Linux only; the BLAS
    half ran before mlx was imported: kernels/cpu `reexec_with_openblas`); on a GPU, MLX's
    cache of freed buffers capped at the profile's buffer_cache_bytes."""
    use_platform(profile)
    if profile.is_cpu:
        cpu.keep_freed_memory()
    elif profile.buffer_cache_bytes:
        import mlx.core as mx

        mx.set_cache_limit(profile.buffer_cache_bytes)
