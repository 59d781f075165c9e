"""The one-kernel DeltaNet decode token (kernels/deltanet_decode.py) against its references.

On CPU: `deltanet_decode` runs its ops path, which must be bit-identical to the model's
`deltanet_core` at L = 1, and a model decoding through it must match one that does not.
On a CUDA or Metal machine the same file runs the kernel against the ops path
(`python -m pytest tests/test_kernel_deltanet_decode.py`); the `gpu` tests need it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from deltaserve.kernels.deltanet_decode import (
    DecodeDims,
    deltanet_decode,
    deltanet_decode_ops,
    deltanet_decode_slots,
    deltanet_decode_slots_ops,
    supported,
)
from deltaserve.models.deltanet import CoreDims, deltanet_core

HAS_GPU = mx.default_device().type == mx.DeviceType.gpu
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA or Metal GPU as default device")

# (Hk, Dk, Hv, Dv): the 0.8B/2B/4B shape's heads, 9B's (Hv = 2 Hk), and a small one
SHAPES = [(16, 128, 16, 128), (16, 128, 32, 128), (2, 128, 4, 128)]

Inputs = tuple[mx.array, ...]


def make_inputs(dims: DecodeDims, b: int, dtype: mx.Dtype, seed: int = 0) -> Inputs:
    """proj, conv_state, ssm, conv_w, a_log, dt_bias, norm_w at the scales of a model."""
    keys = mx.random.split(mx.random.key(seed), 7)
    hv, dv = dims.num_v_heads, dims.head_v_dim
    proj = mx.random.normal((b, dims.proj_dim), key=keys[0]).astype(dtype)
    conv_state = mx.random.normal((b, dims.kernel - 1, dims.conv_dim), key=keys[1]).astype(dtype)
    ssm = mx.random.normal((b, hv, dv, dims.head_k_dim), key=keys[2]) * 0.3
    conv_w = (0.5 * mx.random.normal((dims.conv_dim, dims.kernel), key=keys[3])).astype(dtype)
    a_log = mx.random.normal((hv,), key=keys[4])
    dt_bias = mx.random.normal((hv,), key=keys[5])
    norm_w = 1.0 + 0.1 * mx.random.normal((dv,), key=keys[6])
    return proj, conv_state, ssm, conv_w, a_log, dt_bias, norm_w


def dims_of(hk: int, dk: int, hv: int, dv: int) -> DecodeDims:
    return DecodeDims(hk, dk, hv, dv, 4, 1e-6)


def core(dims: DecodeDims, proj: mx.array, conv_state: mx.array, *rest: mx.array) -> Inputs:
    """deltaserve.models.deltanet.deltanet_core on the same token (y flattened to [B, Hv*Dv])."""
    c, vd, hv = dims.conv_dim, dims.num_v_heads * dims.head_v_dim, dims.num_v_heads
    parts = (
        proj[:, :c],
        proj[:, c : c + vd],
        proj[:, c + vd : c + vd + hv],
        proj[:, c + vd + hv :],
    )
    core_dims = CoreDims(*[dims.num_k_heads, dims.head_k_dim, hv, dims.head_v_dim, dims.norm_eps])
    y, conv, ssm = deltanet_core(core_dims, *[p[:, None] for p in parts], conv_state, *rest)
    return y.reshape(proj.shape[0], -1), conv, ssm


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_ops_path_is_the_model_core(shape: tuple[int, int, int, int], dtype: mx.Dtype) -> None:
    dims = dims_of(*shape)
    inputs = make_inputs(dims, 3, dtype)
    with mx.stream(mx.cpu):
        got = deltanet_decode_ops(dims, *inputs)
        ref = core(dims, *inputs)
        for name, a, r in zip(("y", "conv", "ssm"), got, ref, strict=True):
            assert a.dtype == r.dtype and mx.array_equal(a, r).item(), name


def test_every_qwen35_shape_is_supported_and_others_refused() -> None:
    assert all(supported(dims_of(*s)) for s in SHAPES)
    assert not supported(dims_of(2, 80, 4, 128))  # Dk not a multiple of 32
    assert not supported(dims_of(2, 128, 4, 256))  # a block of 8 * 256 threads
    other = make_inputs(dims_of(2, 128, 2, 128), 1, mx.float32)
    with pytest.raises(ValueError, match="do not fit"):
        deltanet_decode(dims_of(2, 128, 4, 128), *other)


def test_state_and_weights_of_other_sizes_raise() -> None:
    """The kernel indexes its inputs by the layer's sizes and sizes the new state from
    them: a recurrent state of other rows or heads, or a weight of another size, is a
    ValueError (on every device), not a read or write out of bounds."""
    dims = dims_of(16, 128, 32, 128)
    proj, conv, ssm, conv_w, a_log, dt_bias, norm_w = make_inputs(dims, 4, mx.float32)
    with pytest.raises(ValueError, match="ssm"):
        deltanet_decode(dims, proj, conv, ssm[:3], conv_w, a_log, dt_bias, norm_w)
    with pytest.raises(ValueError, match="ssm"):
        deltanet_decode(dims, proj, conv, ssm[:, :16], conv_w, a_log, dt_bias, norm_w)
    with pytest.raises(ValueError, match="a_log"):
        deltanet_decode(dims, proj, conv, ssm, conv_w, a_log[:16], dt_bias, norm_w)
    with pytest.raises(ValueError, match="conv_w"):
        deltanet_decode(dims, proj, conv, ssm, conv_w[:, :3], a_log, dt_bias, norm_w)


# Kernel vs ops: sums run in another order and the kernel rounds the conv once less;
# y is T after a norm, so one T ulp of its O(1) values (bf16 2^-8), state in float32.
TOL = {mx.float32: 2e-4, mx.bfloat16: 3e-2}
# two kernels doing the same arithmetic, compiled apart: FMA contraction may differ
SAME_TOL = {mx.float32: 1e-5, mx.bfloat16: 1e-2}


@gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("b", [1, 5, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_ops(shape: tuple[int, int, int, int], b: int, dtype: mx.Dtype) -> None:
    dims = dims_of(*shape)
    inputs = make_inputs(dims, b, dtype, seed=b)
    got = deltanet_decode(dims, *inputs)
    ref = deltanet_decode_ops(dims, *inputs)
    for name, a, r in zip(("y", "conv", "ssm"), got, ref, strict=True):
        assert (a.shape, a.dtype) == (r.shape, r.dtype), name
        if name == "conv":  # a copy: exact
            assert mx.array_equal(a, r).item(), name
            continue
        scale = max(1.0, mx.abs(r.astype(mx.float32)).max().item())
        err = mx.abs(a.astype(mx.float32) - r.astype(mx.float32)).max().item()
        assert err <= TOL[dtype] * scale, f"{name}: max abs err {err:.3g} (scale {scale:.3g})"


def make_columns(dims: DecodeDims, b: int, columns: int, dtype: mx.Dtype, seed: int = 0) -> Inputs:
    """make_inputs with proj [B, columns, P] (a verify's last token and drafts)."""
    proj, *rest = make_inputs(dims, b * columns, dtype, seed)
    conv, ssm = rest[0][:b], rest[1][:b]
    return (proj.reshape(b, columns, -1), conv, ssm, *rest[2:])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_slots_ops_path_is_the_model_core_every_state(
    shape: tuple[int, int, int, int], dtype: mx.Dtype
) -> None:
    """`deltanet_decode_slots`' reference, a decode token a column, is the model's
    `deltanet_core(every_state=True)` (what a verify ran before): y, and the conv tail
    and state after every column."""
    dims = dims_of(*shape)
    proj, conv, ssm, *weights = make_columns(dims, 2, 3, dtype)
    c, vd, hv = dims.conv_dim, dims.num_v_heads * dims.head_v_dim, dims.num_v_heads
    parts = (proj[..., :c], proj[..., c : c + vd], proj[..., c + vd : c + vd + hv],
             proj[..., c + vd + hv :])  # fmt: skip
    core_dims = CoreDims(dims.num_k_heads, dims.head_k_dim, hv, dims.head_v_dim, dims.norm_eps)
    with mx.stream(mx.cpu):
        got = deltanet_decode_slots_ops(dims, proj, conv, ssm, *weights)
        ref = deltanet_core(core_dims, *parts, conv, ssm, *weights, every_state=True)
        for name, a, r in zip(("y", "conv", "ssm"), got, ref, strict=True):
            assert (a.shape, a.dtype) == (r.shape, r.dtype), name
            err = mx.abs(a.astype(mx.float32) - r.astype(mx.float32)).max().item()
            assert err <= TOL[dtype] * max(1.0, mx.abs(r).max().item()), (name, err)


def test_slots_of_other_sizes_raise() -> None:
    dims = dims_of(16, 128, 32, 128)
    proj, conv, ssm, *weights = make_columns(dims, 4, 3, mx.float32)
    with pytest.raises(ValueError, match="ssm"):
        deltanet_decode_slots(dims, proj, conv, ssm[:3], *weights)
    with pytest.raises(ValueError, match="do not fit"):
        deltanet_decode_slots(dims, proj[..., :-1], conv, ssm, *weights)


@gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("columns", [1, 3])
@pytest.mark.parametrize("b", [1, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_slots_kernel_is_the_decode_kernel_column_by_column(
    shape: tuple[int, int, int, int], b: int, columns: int, dtype: mx.Dtype
) -> None:
    """The many-column kernel is the decode kernel run once a column: every column's conv
    tail bit for bit (copies), y and the state within a few float32 roundings (the two
    kernels are compiled separately and NVRTC contracts their multiply-adds into FMAs
    where each one's code allows: on an H100 a float32 y differed from the third column
    on, bf16 did not), and its reference within the kernel's tolerance."""
    dims = dims_of(*shape)
    proj, conv, ssm, *weights = make_columns(dims, b, columns, dtype, seed=b + columns)
    got = deltanet_decode_slots(dims, proj, conv, ssm, *weights)
    stepped, c, s = [], conv, ssm
    for t in range(columns):
        y, c, s = deltanet_decode(dims, proj[:, t], c, s, *weights)
        stepped.append((y, c, s))
    ref = deltanet_decode_slots_ops(dims, proj, conv, ssm, *weights)
    for i, name in enumerate(("y", "conv", "ssm")):
        one_by_one = mx.stack([step[i] for step in stepped], axis=1)
        assert (got[i].shape, got[i].dtype) == (one_by_one.shape, one_by_one.dtype), name
        if name == "conv":
            assert mx.array_equal(got[i], one_by_one).item(), name
        else:
            scale = max(1.0, mx.abs(one_by_one.astype(mx.float32)).max().item())
            diff = mx.abs(got[i].astype(mx.float32) - one_by_one.astype(mx.float32))
            assert diff.max().item() <= SAME_TOL[got[i].dtype] * scale, (name, diff.max().item())
        scale = max(1.0, mx.abs(ref[i].astype(mx.float32)).max().item())
        err = mx.abs(got[i].astype(mx.float32) - ref[i].astype(mx.float32)).max().item()
        assert err <= TOL[dtype] * scale, f"{name}: max abs err {err:.3g} (scale {scale:.3g})"


# float32 (TF32 off on a GPU: bench/gpu_tests.sh): in bf16 greedy tokens of random weights
# part after differences of one rounding; test_kernel_matches_ops holds the kernel to its
# reference there.
@pytest.mark.parametrize("compiled", [False, True])
def test_engine_decoding_through_it_is_unchanged(compiled: bool) -> None:
    """Greedy tokens of a batch (rows joining mid-decode) with every DeltaNet layer's
    decode token through `deltanet_decode` equal the plain layer's, compiled step or not."""
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import SamplingParams
    from deltaserve.models.build import load_model
    from deltaserve.models.deltanet import GatedDeltaNet
    from deltaserve.models.testing import cached_checkpoint

    loaded = load_model(str(cached_checkpoint("tiny")), dtype=mx.float32)
    mixers = [m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet)]
    assert mixers
    prompts = [list(range(5 + i, 40 + 7 * i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for fused in (False, True):
        for m in mixers:
            m.fused_decode = fused
        config = EngineConfig(compile_decode=compiled, max_num_seqs=3, max_num_batched_tokens=48)
        out = LLMEngine(loaded, config).generate(prompts, params)
        tokens.append([c.token_ids for c in out])
    assert tokens[0] == tokens[1]
