"""A DeltaNet prompt chunk as kernels (kernels/deltanet_chunk.py) against its references.

On the CPU: `deltanet_chunk` runs `deltanet_chunk_ops` (decode tokens one by one), which
must follow the model's `deltanet_core` over left-padded chunks with history, and a model
whose prompt chunks take that path must write the plain model's tokens. On a CUDA
machine the same file runs the kernels against the ops path (bench/gpu_tests.sh).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from deltaserve.kernels.deltanet_chunk import deltanet_chunk, deltanet_chunk_ops, uses_kernels
from deltaserve.kernels.deltanet_decode import DecodeDims
from deltaserve.kernels.platform import current_platform
from deltaserve.models.deltanet import CoreDims, deltanet_core

HAS_CUDA = current_platform().device == "cuda"
cuda = pytest.mark.skipif(not HAS_CUDA, reason="the kernels are CUDA's (a CUDA default device)")

# (Hk, Dk, Hv, Dv): the 0.8B shape's heads, 9B's (Hv = 2 Hk), and a small one
SHAPES = [(16, 128, 16, 128), (16, 128, 32, 128), (2, 128, 4, 128)]


def dims_of(hk: int, dk: int, hv: int, dv: int) -> DecodeDims:
    return DecodeDims(hk, dk, hv, dv, 4, 1e-6)


def make_inputs(dims: DecodeDims, b: int, length: int, dtype: mx.Dtype, seed: int = 0) -> tuple:
    """proj [B, L, P], conv_state, ssm, conv_w, a_log, dt_bias, norm_w at a model's scales."""
    keys = mx.random.split(mx.random.key(seed), 7)
    hv, dv = dims.num_v_heads, dims.head_v_dim
    proj = mx.random.normal((b, length, dims.proj_dim), key=keys[0]).astype(dtype)
    conv_state = mx.random.normal((b, dims.kernel - 1, dims.conv_dim), key=keys[1]).astype(dtype)
    ssm = mx.random.normal((b, hv, dv, dims.head_k_dim), key=keys[2]) * 0.3
    conv_w = (0.5 * mx.random.normal((dims.conv_dim, dims.kernel), key=keys[3])).astype(dtype)
    a_log = mx.random.normal((hv,), key=keys[4])
    dt_bias = mx.random.normal((hv,), key=keys[5])
    norm_w = 1.0 + 0.1 * mx.random.normal((dv,), key=keys[6])
    return proj, conv_state, ssm, conv_w, a_log, dt_bias, norm_w


def padding(pads: list[int], length: int) -> tuple[mx.array, mx.array]:
    """left_pad [B] int32 and the mask [B, L] of the same padding."""
    left_pad = mx.array(pads, dtype=mx.int32)
    return left_pad, mx.arange(length, dtype=mx.int32)[None] >= left_pad[:, None]


def core(dims: DecodeDims, proj: mx.array, *rest: mx.array, mask=None, left_pad=None) -> tuple:
    """The model's deltanet_core over the same chunk, proj split as the model splits it."""
    c, vd, hv = dims.conv_dim, dims.num_v_heads * dims.head_v_dim, dims.num_v_heads
    parts = (
        proj[..., :c],
        proj[..., c : c + vd],
        proj[..., c + vd : c + vd + hv],
        proj[..., c + vd + hv :],
    )
    core_dims = CoreDims(dims.num_k_heads, dims.head_k_dim, hv, dims.head_v_dim, dims.norm_eps)
    masked = () if mask is None else (mask, left_pad)
    return deltanet_core(core_dims, *parts, *rest, *masked)


def close(a: mx.array, r: mx.array, tol: float) -> float:
    """Max abs error of a against r relative to r's scale (at least 1); asserts shapes."""
    assert (a.shape, a.dtype) == (r.shape, r.dtype)
    scale = max(1.0, mx.abs(r.astype(mx.float32)).max().item())
    err = mx.abs(a.astype(mx.float32) - r.astype(mx.float32)).max().item()
    assert err <= tol * scale, f"max abs err {err:.3g} (scale {scale:.3g})"
    return err


@pytest.mark.parametrize("pads", [None, [0, 3, 9, 12]])
def test_ops_path_is_the_model_core(pads: list[int] | None) -> None:
    """Token by token (the ops path) == the model's core over the whole chunk, rows with
    history and padding of every extent (none, some, all but a few, all): conv tails
    exactly, outputs and states to float32's rounding of another summation order."""
    dims = dims_of(2, 128, 4, 128)
    length = 12
    proj, conv_state, ssm, *weights = make_inputs(dims, 4, length, mx.float32)
    left_pad, mask = padding(pads, length) if pads else (None, None)
    with mx.stream(mx.cpu):
        got = deltanet_chunk_ops(dims, proj, conv_state, ssm, *weights, mask)
        ref = core(dims, proj, conv_state, ssm, *weights, mask=mask, left_pad=left_pad)
    y, conv, state = got
    y_ref, conv_ref, state_ref = ref
    close(y, y_ref.reshape(y.shape), 1e-4)
    assert mx.array_equal(conv, conv_ref).item()
    close(state, state_ref, 1e-4)
    if pads:  # the all-padding row kept its state and wrote zeros
        assert mx.array_equal(state[3], ssm[3]).item() and not mx.any(y[3]).item()


def test_padding_must_come_with_its_mask_and_shapes_must_fit() -> None:
    dims = dims_of(2, 128, 4, 128)
    proj, conv_state, ssm, *weights = make_inputs(dims, 2, 5, mx.float32)
    left_pad, _ = padding([0, 1], 5)
    with pytest.raises(ValueError, match="both or neither"):
        deltanet_chunk(dims, proj, conv_state, ssm, *weights, left_pad, None)
    with pytest.raises(ValueError, match="do not fit"):
        deltanet_chunk(dims, proj[..., 1:], conv_state, ssm, *weights)
    with pytest.raises(ValueError, match="ssm"):
        deltanet_chunk(dims, proj, conv_state, ssm[:1], *weights)


def test_the_kernels_run_only_where_the_profile_says() -> None:
    """The CPU has no kernel (the ops path), whatever the switch."""
    assert uses_kernels(dims_of(16, 128, 16, 128)) == (
        HAS_CUDA and current_platform().fused_deltanet_chunk and current_platform().deltanet_scan
    )


@pytest.mark.parametrize("compiled", [False, True])
def test_engine_prompts_through_it_write_the_same_tokens(compiled: bool) -> None:
    """Greedy tokens of a batch whose prompts come in several chunks (left-padded groups,
    later chunks over history) with every DeltaNet layer's prompt chunks through
    `deltanet_chunk` (its ops path here) equal the plain layers', the compiled prompt
    paths on or off; float32 (TF32 off on a GPU: bench/gpu_tests.sh), where the kernels
    run on CUDA."""
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import SamplingParams
    from deltaserve.models.build import load_model
    from deltaserve.models.deltanet import GatedDeltaNet
    from deltaserve.models.testing import cached_checkpoint

    loaded = load_model(str(cached_checkpoint("tiny")), dtype=mx.float32)
    mixers = [m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet)]
    assert mixers
    prompts = [list(range(5 + i, 40 + 9 * i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for fused in (False, True):
        for m in mixers:
            m.fused_chunk = fused
        config = EngineConfig(
            compile_decode=compiled, compile_chunks=compiled, compile_prompt=compiled,
            batch_prefill=True, max_num_seqs=3, max_num_batched_tokens=32,
            max_prefill_chunk=24, warm_up_seconds=0,
        )  # fmt: skip
        out = LLMEngine(loaded, config).generate(prompts, params)
        tokens.append([c.token_ids for c in out])
    for m in mixers:
        m.fused_chunk = None
    assert tokens[0] == tokens[1]


# Kernels vs ops: the scan sums in another order than the per-token state step and the
# prologue normalises in float32 once; y is T after a norm (bf16: 2^-8 of O(1) values,
# grown over the chunk's tokens through the state), the state float32.
TOL = {mx.float32: 1e-3, mx.bfloat16: 6e-2}


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("b,length", [(1, 2), (1, 16), (3, 37), (2, 130)])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_ops(
    shape: tuple[int, int, int, int], b: int, length: int, padded: bool, dtype: mx.Dtype
) -> None:
    dims = dims_of(*shape)
    assert uses_kernels(dims)
    proj, conv_state, ssm, *weights = make_inputs(dims, b, length, dtype, seed=length)
    left_pad, mask = None, None
    if padded:  # the last row all padding, the others some (a bucketed group's)
        pads = [(3 * r) % length for r in range(b - 1)] + [length]
        left_pad, mask = padding(pads, length)
    got = deltanet_chunk(dims, proj, conv_state, ssm, *weights, left_pad, mask)
    ref = deltanet_chunk_ops(dims, proj, conv_state, ssm, *weights, mask)
    for name, a, r in zip(("y", "conv", "ssm"), got, ref, strict=True):
        if name == "conv":  # copies of inputs: exact
            assert (a.shape, a.dtype) == (r.shape, r.dtype) and mx.array_equal(a, r).item()
            continue
        close(a, r, TOL[dtype])
    if padded:
        assert mx.array_equal(got[2][-1], ssm[-1]).item() and not mx.any(got[0][-1]).item()
