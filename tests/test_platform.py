"""kernels/platform.py: the platform profile resolved from the device and the config's
switches, its log line, switches that really route to the reference paths, and the Linux
CPU set-up (kernels/cpu) that stays off on macOS."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import mlx.core as mx
import pytest

from deltaserve.engine.api import EngineSummary
from deltaserve.engine.async_engine import engine_info
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.kernels import cpu, deltanet_decode, gated_delta_fused, rms_norm
from deltaserve.kernels.cpu import blas, host_memory
from deltaserve.kernels.platform import (
    CUDA_BUFFER_CACHE_BYTES,
    CUDA_GRAPHS_VARIABLE,
    FUSED_KERNEL_DEVICES,
    Platform,
    current_platform,
    mlx_cuda_graphs,
    prepare_device,
    resolve_platform,
    start_platform,
    use_platform,
)
from deltaserve.models.build import load_model
from deltaserve.models.testing import cached_checkpoint
from deltaserve.server.settings import ModelSettings, Settings
from deltaserve.server.startup import summary_lines

KERNELS = tuple(FUSED_KERNEL_DEVICES)
STEP_SHAPES = (
    "compile_decode",
    "compile_prompt",
    "compile_chunks",
    "compile_prefill",
    "batch_prefill",
    "pipeline_steps",
    "pipeline_verify",
    "submit_decode_first",
)


def _kernel_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("the fused kernel ran")


def test_device_defaults() -> None:
    """Unset switches: the CPU runs plain ops and packs token-wise; CUDA has every kernel
    and the GPU step shapes; Metal all but the CUDA-only scan; no device publishes a
    mixed step's decode rows first (measured slower on an H100) nor hands a step's tokens
    off to the event loop before the next (no shorter gaps on an H100)."""
    cpu_profile = resolve_platform(EngineConfig(), "float32", device="cpu")
    assert cpu_profile.pack_token_wise
    assert not any(getattr(cpu_profile, k) for k in (*KERNELS, *STEP_SHAPES))
    cuda = resolve_platform(EngineConfig(), device="cuda")
    assert all(getattr(cuda, k) for k in (*KERNELS, *STEP_SHAPES)) and not cuda.pack_token_wise
    metal = resolve_platform(None, device="metal")
    assert not metal.deltanet_scan
    assert metal.fused_deltanet_decode and metal.fused_rms_norm and metal.fused_gated_delta_step
    assert not any(p.publish_decode_first for p in (cpu_profile, cuda, metal))
    assert not any(p.stream_handoff for p in (cpu_profile, cuda, metal))  # no gain measured


@pytest.mark.parametrize("device", ["cpu", "cuda", "metal"])
def test_explicit_switches_beat_the_device_default(device: str) -> None:
    """Each switch set against the device's default wins: off on a GPU, on on the CPU."""
    default = resolve_platform(EngineConfig(), device=device)
    flipped = {k: not v for k, v in default.switches().items()}
    flipped = {
        k: v
        for k, v in flipped.items()
        if not v or device in FUSED_KERNEL_DEVICES.get(k, (device,))
    }
    profile = resolve_platform(EngineConfig(**flipped), device=device)
    for key, value in flipped.items():
        assert getattr(profile, key) == value, key


def test_only_a_rank_that_samples_publishes_decode_rows_first() -> None:
    """publish_decode_first draws the decode rows' tokens inside a step: a single engine
    and rank 0 of a tensor-parallel group keep the switch, a follower rank (which never
    samples) has it off, and its pipelined steps stay as the device has them."""
    from types import SimpleNamespace

    from deltaserve.engine.engine import _platform

    config = EngineConfig(publish_decode_first=True, pipeline_steps=True)
    alone = SimpleNamespace(dtype=mx.float32, parallel=None)
    ranked = SimpleNamespace(dtype=mx.float32, parallel=object())
    leader = object()
    assert _platform(config, alone, None).publish_decode_first  # type: ignore[arg-type]
    rank0 = _platform(config, ranked, leader)  # type: ignore[arg-type]
    assert rank0.publish_decode_first and not rank0.pipeline_steps
    follower = _platform(config, ranked, None)  # type: ignore[arg-type]
    assert not follower.publish_decode_first and follower.pipeline_steps


def test_a_kernel_the_device_lacks_stays_off(caplog: pytest.LogCaptureFixture) -> None:
    """Switched on where there is no source for it (the CPU; the scan on Metal), a kernel
    stays off and the log says so; the profile refuses such a state outright."""
    config = EngineConfig(fused_rms_norm=True, deltanet_scan=True)
    with caplog.at_level(logging.WARNING):
        assert not resolve_platform(config, device="cpu").fused_rms_norm
        assert not resolve_platform(config, device="metal").deltanet_scan
    assert "fused_rms_norm is on in the config but has no cpu kernel" in caplog.text
    assert "deltanet_scan is on in the config but has no metal kernel" in caplog.text
    with pytest.raises(AssertionError):
        Platform("cpu", fused_gated_delta_step=True)


def test_profile_of_this_process_is_the_cpu() -> None:
    """Without an engine the profile is the device's defaults, with the BLAS described."""
    profile = current_platform()
    assert profile.device == "cpu" and profile.mlx_version == mx.__version__
    assert profile.blas and not profile.fused_rms_norm


def test_log_line_says_device_dtype_blas_and_each_switch() -> None:
    """One line: device and its name, dtype, mlx, BLAS, then every path on and off."""
    profile = Platform(
        "metal", "Apple M3", "bfloat16", "0.31.1", fused_rms_norm=True, compile_decode=True
    )
    line = profile.describe()
    assert "\n" not in line
    assert line.startswith("platform: metal (Apple M3), bfloat16, mlx 0.31.1; on: ")
    assert "on: compile_decode, fused_rms_norm; off: compile_prompt, compile_chunks," in line
    assert line.endswith("fused_deltanet_decode, fused_gated_delta_step") and "BLAS" not in line
    cpu_line = Platform("cpu", blas="OpenBLAS (/x.so)", pack_token_wise=True).describe()
    assert "; BLAS: OpenBLAS (/x.so); on: pack_token_wise; off: compile_decode" in cpu_line


def test_start_up_summary_prints_the_profile() -> None:
    """server/startup.py's summary carries the profile's line in place of a device line."""
    profile = Platform("cpu", "AMD EPYC", "float32", "0.31.1", "OpenBLAS (/x.so)")
    summary = EngineSummary(profile, 1, 1, 0, 1, 4096, 4096, 1, 1, 0)
    settings = Settings(model=ModelSettings(path="/m/demo", served_name="demo"))
    lines = summary_lines(summary, settings, "http://127.0.0.1:8000", (1, "now"))
    assert lines[1] == f"  {profile.describe()}"


def _bf16(*shape: int) -> mx.array:
    return mx.random.normal(shape).astype(mx.bfloat16)


def test_rms_norm_switch_routes_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a (faked) GPU the bf16 norm goes to the kernel; switched off, to rms_norm_ops."""
    monkeypatch.setattr(rms_norm, "_kernel", _kernel_called)
    x, w = _bf16(2, 64), mx.ones((64,), mx.float32)
    use_platform(Platform("cuda", fused_rms_norm=True))
    with pytest.raises(AssertionError, match="fused kernel ran"):
        rms_norm.rms_norm(x, w, 1e-6)
    use_platform(Platform("cuda", fused_rms_norm=False))
    assert mx.array_equal(rms_norm.rms_norm(x, w, 1e-6), rms_norm.rms_norm_ops(x, w, 1e-6))


def test_gated_delta_step_switch_routes_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched off on a (faked) Metal GPU the step is gated_delta_step's, not the kernel."""
    monkeypatch.setattr(gated_delta_fused, "_gpu_step", _kernel_called)
    b, hk, hv, dk, dv = 2, 2, 4, 32, 32
    q, k = mx.random.normal((b, 1, hk, dk)), mx.random.normal((b, 1, hk, dk))
    v, g, beta = mx.random.normal((b, 1, hv, dv)), -mx.ones((b, 1, hv)), mx.ones((b, 1, hv)) / 2
    use_platform(Platform("metal", fused_gated_delta_step=True))
    with pytest.raises(AssertionError, match="fused kernel ran"):
        gated_delta_fused.gated_delta_step_fused(q, k, v, g, beta, None)
    use_platform(Platform("metal", fused_gated_delta_step=False))
    y, state = gated_delta_fused.gated_delta_step_fused(q, k, v, g, beta, None)
    ref_y, ref_state = gated_delta_fused.gated_delta_step(q, k, v, g, beta, None)
    assert mx.array_equal(y, ref_y) and mx.array_equal(state, ref_state)


def test_deltanet_decode_switch_routes_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched off on a (faked) GPU the decode token is deltanet_decode_ops'; the model's
    default follows the profile too."""
    from deltaserve.models.deltanet import fused_decode_default

    monkeypatch.setattr(deltanet_decode, "_kernel", _kernel_called)
    dims = deltanet_decode.DecodeDims(2, 32, 4, 32, 4, 1e-6)
    b = 2
    proj = mx.random.normal((b, dims.proj_dim))
    conv = mx.random.normal((b, dims.kernel - 1, dims.conv_dim))
    ssm = mx.zeros((b, 4, 32, 32))
    weights = (
        mx.random.normal((dims.conv_dim, dims.kernel)),
        mx.zeros((4,)),
        mx.ones((4,)),
        mx.ones((32,)),
    )
    use_platform(Platform("cuda", fused_deltanet_decode=True))
    assert fused_decode_default()
    with pytest.raises(AssertionError, match="fused kernel ran"):
        deltanet_decode.deltanet_decode(dims, proj, conv, ssm, *weights)
    use_platform(Platform("cuda", fused_deltanet_decode=False))
    assert not fused_decode_default()
    got = deltanet_decode.deltanet_decode(dims, proj, conv, ssm, *weights)
    ref = deltanet_decode.deltanet_decode_ops(dims, proj, conv, ssm, *weights)
    assert all(mx.array_equal(a, r) for a, r in zip(got, ref, strict=True))


def test_engine_resolves_once_and_both_descriptions_share_it() -> None:
    """The engine's config switches land in its profile, which becomes current and is the
    one EngineInfo (status page) and EngineSummary (start-up log) both show."""
    loaded = load_model(str(cached_checkpoint("tiny")))
    config = EngineConfig(compile_decode=True, pack_token_wise=False, memory_budget_bytes=1 << 26)
    engine = LLMEngine(loaded, config)
    profile = engine.platform
    assert profile.compile_decode and not profile.pack_token_wise and profile.dtype == "float32"
    assert current_platform() is profile and engine.runner is not None
    assert engine_info(engine).platform is profile and engine.summary().platform is profile
    assert loaded.model.pack_token_wise is False


def test_kv_start_turns_compiled_decode_off_in_the_profile() -> None:
    """A path the engine cannot take is off in the profile it logs, not just skipped."""
    loaded = load_model(str(cached_checkpoint("tiny")))
    kv = dataclasses.replace(EngineConfig().kv_cache, kind="affine", start=16)
    config = EngineConfig(compile_decode=True, kv_cache=kv, memory_budget_bytes=1 << 26)
    assert not LLMEngine(loaded, config).platform.compile_decode


def test_cpu_setup_is_linux_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On macOS (faked) neither the BLAS re-exec nor the malloc tuning runs, even for a
    CPU profile; the BLAS is named Accelerate."""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(blas, "ensure_openblas", _kernel_called)
    monkeypatch.setattr(host_memory, "keep_freed_memory", _kernel_called)
    cpu.reexec_with_openblas()
    assert cpu.keep_freed_memory() is False
    start_platform(Platform("cpu"))
    assert cpu.blas_in_use() == "Accelerate"
    assert resolve_platform(device="cpu").blas == "Accelerate"


def test_cpu_setup_runs_on_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Linux a CPU profile's start tunes malloc once; a GPU profile's does not."""
    calls: list[str] = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append("malloc"))
    start_platform(Platform("cuda"))
    assert calls == []
    start_platform(Platform("cpu"))
    assert calls == ["malloc"]


def test_gpu_buffer_cache_is_capped_on_cuda_by_default(caplog: pytest.LogCaptureFixture) -> None:
    """Unset, CUDA caps MLX's cache of freed buffers (CUDA_BUFFER_CACHE_BYTES) and Metal
    keeps MLX's own cap; a configured cap wins on a GPU, 0 means MLX's; the CPU, whose
    freed buffers glibc keeps, ignores one with a warning. The log line says the cap."""
    cuda = resolve_platform(EngineConfig(), device="cuda")
    assert cuda.buffer_cache_bytes == CUDA_BUFFER_CACHE_BYTES
    assert "freed buffers kept: up to 4.0 GiB" in cuda.describe()
    assert resolve_platform(EngineConfig(), device="metal").buffer_cache_bytes == 0
    mlx_own = resolve_platform(EngineConfig(buffer_cache_bytes=0), device="cuda")
    assert mlx_own.buffer_cache_bytes == 0
    metal = resolve_platform(EngineConfig(buffer_cache_bytes=1 << 30), device="metal")
    assert metal.buffer_cache_bytes == 1 << 30 and "up to 1.0 GiB" in metal.describe()
    with caplog.at_level(logging.WARNING):
        cpu_profile = resolve_platform(EngineConfig(buffer_cache_bytes=1 << 30), device="cpu")
    assert cpu_profile.buffer_cache_bytes == 0 and "freed buffers" not in cpu_profile.describe()
    assert "buffer_cache_bytes is for a GPU" in caplog.text
    with pytest.raises(ValueError, match="buffer_cache_bytes"):
        EngineConfig(buffer_cache_bytes=-1)


def test_gpu_start_sets_the_buffer_cache_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a GPU profile hands its cap to MLX once; a cap of 0 leaves MLX's alone, and
    a CPU profile's start tunes malloc instead."""
    limits: list[int] = []
    monkeypatch.setattr(mx, "set_cache_limit", limits.append)
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: limits.append(-1))
    monkeypatch.setattr(sys, "platform", "linux")
    start_platform(Platform("cuda", buffer_cache_bytes=3 << 30))
    start_platform(Platform("metal"))
    start_platform(Platform("cpu"))
    assert limits == [3 << 30, -1]


def test_cuda_graphs_are_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare_device` sets MLX_USE_CUDA_GRAPHS before MLX reads it: unset config, off
    unless the variable is already there (kept); an explicit config value wins. The CUDA
    profile reports the variable as MLX reads it (atoi: "false" is 0); other devices have
    no CUDA graphs."""
    monkeypatch.delenv(CUDA_GRAPHS_VARIABLE, raising=False)
    assert mlx_cuda_graphs()  # MLX's own default
    prepare_device(EngineConfig())
    assert os.environ[CUDA_GRAPHS_VARIABLE] == "0"
    cuda = resolve_platform(EngineConfig(), device="cuda")
    assert not cuda.cuda_graphs and "CUDA graphs off" in cuda.describe()
    monkeypatch.setenv(CUDA_GRAPHS_VARIABLE, "1")
    prepare_device(EngineConfig())
    assert os.environ[CUDA_GRAPHS_VARIABLE] == "1"
    assert resolve_platform(EngineConfig(), device="cuda").cuda_graphs
    assert not resolve_platform(EngineConfig(), device="metal").cuda_graphs
    assert "CUDA graphs" not in resolve_platform(EngineConfig(), device="cpu").describe()
    prepare_device(EngineConfig(cuda_graphs=False))
    assert os.environ[CUDA_GRAPHS_VARIABLE] == "0"
    prepare_device(EngineConfig(cuda_graphs=True))
    assert "CUDA graphs on" in resolve_platform(EngineConfig(), device="cuda").describe()
    for value, on in (("false", False), (" 2", True), ("", False), ("-0", False)):
        monkeypatch.setenv(CUDA_GRAPHS_VARIABLE, value)
        assert mlx_cuda_graphs() is on, value


def test_the_engine_start_prepares_the_device_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`start_engine` (the server's and AsyncEngine's path) sets MLX's once-read settings
    before the weights load: loading is MLX's first evaluation on a GPU."""
    from deltaserve.engine.parallel import tensor_parallel

    seen: list[str | None] = []

    def load(*args: object, **kwargs: object) -> None:
        seen.append(os.environ.get(CUDA_GRAPHS_VARIABLE))
        raise RuntimeError("stop here")

    monkeypatch.delenv(CUDA_GRAPHS_VARIABLE, raising=False)
    monkeypatch.setattr(tensor_parallel, "load_model", load)
    with pytest.raises(RuntimeError, match="stop here"):
        tensor_parallel.start_engine("unused", EngineConfig())
    assert seen == ["0"]
