"""Quantized MoE experts stay packed on the Metal/CUDA path (QuantizedSwitchExperts,
gather_qmm), run here on the CPU by pretending the device is not the CPU: same logits and
greedy tokens as the CPU path, which dequantizes the same 4-bit checkpoint to float32."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import deltaserve.models.build as build
from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import SamplingParams
from deltaserve.models.layers import QuantizedSwitchExperts, SparseMoE, SwitchExperts
from deltaserve.models.loader import Checkpoint, CheckpointError
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint

NAME = "tiny-moe-mlx-4bit"
# Both paths use the same 4-bit values; only the kernel differs (gather_qmm vs dequantize
# then gather_mm / BLAS), so the difference is float32 summation order: 1e-4 of the
# largest logit, as for the dense quantized path (tests/test_model_quantized_path.py).
REL_TOL = 1e-4
PROMPTS = [[1, 2, 3, 248045, 77, 4000], [9000, 12, 5, 88, 131000, 7, 7, 7, 42, 100, 2048]]


@pytest.fixture(scope="module")
def reference() -> build.LoadedModel:
    """The CPU path: everything dequantized to float32 at load."""
    return build.load_model(str(cached_checkpoint(NAME)))


@pytest.fixture(scope="module")
def kept() -> build.LoadedModel:
    """The Metal/CUDA path (keep_quantized), in float32 so only the kernels differ."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "on_cpu", lambda: False)
        return build.load_model(str(cached_checkpoint(NAME)), dtype=mx.float32)


def _logits(loaded: build.LoadedModel, tokens: mx.array) -> np.ndarray:
    """Teacher-forced logits of rows tokens [B, L] from an empty state -> [B, L, V]."""
    states = BatchState.empty(loaded.config).layers
    positions = text_positions([0] * tokens.shape[0], tokens.shape[1])
    hidden = loaded.model([ForwardGroup(tokens, positions, states)])[0]
    return np.array(loaded.model.logits(hidden))


def _moe_layers(loaded: build.LoadedModel) -> list[SparseMoE]:
    return [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE)]


def _expert_bytes(loaded: build.LoadedModel) -> int:
    params = [mlp.experts.parameters() for mlp in _moe_layers(loaded)]
    return sum(v.nbytes for p in params for _, v in nn.utils.tree_flatten(p))


def test_experts_stay_packed(kept: build.LoadedModel, reference: build.LoadedModel) -> None:
    """Every MoE layer holds QuantizedSwitchExperts with uint32 packed weights; no float
    expert weight exists anywhere in the model."""
    assert kept.quantized and _moe_layers(kept)
    for mlp in _moe_layers(kept):
        assert type(mlp.experts) is QuantizedSwitchExperts
        for proj in (mlp.experts.gate_proj, mlp.experts.up_proj, mlp.experts.down_proj):
            assert proj.weight.dtype == mx.uint32 and proj.bits == 4 and proj.mode == "affine"
    names = [k for k, _ in nn.utils.tree_flatten(kept.model.parameters()) if ".experts." in k]
    assert names and all(k.endswith((".weight", ".scales", ".biases")) for k in names)
    assert all(type(m.experts) is SwitchExperts for m in _moe_layers(reference))


def test_weight_bytes_reflect_packed_experts(
    kept: build.LoadedModel, reference: build.LoadedModel
) -> None:
    """4-bit experts with float32 scales/biases per 64 weights take 0.16 of their float32
    size (0.5 + 8/64 bytes of 4): well under 0.2 of it; the whole model well under half."""
    assert _expert_bytes(kept) <= 0.2 * _expert_bytes(reference)
    assert kept.weight_bytes() <= 0.5 * reference.weight_bytes()


@pytest.mark.parametrize("shape", [(3, 16), (1, 1)], ids=["many-tokens", "single-token"])
def test_logits_match_dequantized(
    kept: build.LoadedModel, reference: build.LoadedModel, shape: tuple[int, int]
) -> None:
    """48 tokens x top-2 = 96 expert rows through the sort-by-expert path, and one token
    (2 rows): relative logit error <= REL_TOL against the float32 reference."""
    tokens = mx.array(np.random.default_rng(0).integers(100, 240000, size=shape), mx.int32)
    ours, ref = _logits(kept, tokens), _logits(reference, tokens)
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= REL_TOL


@pytest.mark.parametrize("gpu_defaults", [False, True], ids=["cpu-defaults", "gpu-defaults"])
def test_greedy_tokens_match_dequantized(
    kept: build.LoadedModel,
    reference: build.LoadedModel,
    gpu_defaults: bool,
) -> None:
    """Greedy continuations through the engine are token-exact against the float32
    reference (the checkpoint's logits are peaked, so rounding cannot flip a choice);
    gpu-defaults also runs the GPU's step shapes (compiled decode step, batched prefill,
    pipelined steps, no token-wise packing) over gather_qmm, switched on in the config."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [c.token_ids for c in LLMEngine(reference, EngineConfig()).generate(PROMPTS, params)]
    config = EngineConfig()
    if gpu_defaults:
        config = dataclasses.replace(
            config,
            compile_decode=True,
            batch_prefill=True,
            pipeline_steps=True,
            pack_token_wise=False,
            memory_budget_bytes=1 << 30,
        )
    got = [c.token_ids for c in LLMEngine(kept, config).generate(PROMPTS, params)]
    assert got == expected
    assert len(set(expected[0])) > 1  # a real continuation, not one repeated token


def test_half_quantized_experts_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts quantized in only some projections raise a clear error, never a silent
    dequantization."""
    real = build.load_checkpoint

    def drop_down_proj_quantization(*args: object, **kwargs: object) -> Checkpoint:
        ckpt = real(*args, **kwargs)
        name = "layers.0.mlp.experts.down_proj"
        spec = ckpt.quantization.pop(name)
        scales = ckpt.weights.pop(f"{name}.scales")
        biases = ckpt.weights.pop(f"{name}.biases")
        ckpt.weights[name] = mx.dequantize(ckpt.weights[name], scales, biases, **spec)
        return ckpt

    monkeypatch.setattr(build, "on_cpu", lambda: False)
    monkeypatch.setattr(build, "load_checkpoint", drop_down_proj_quantization)
    with pytest.raises(CheckpointError, match="down_proj.*not quantized"):
        build.load_model(str(cached_checkpoint(NAME)), dtype=mx.float32)


@pytest.mark.parametrize(
    "specs",
    [
        {
            "gate_proj": (64, 4, "affine"),
            "up_proj": (64, 4, "affine"),
            "down_proj": (32, 8, "affine"),
        },
        {p: (32, 4, "mxfp4") for p in ("gate_proj", "up_proj", "down_proj")},
    ],
    ids=["mixed-bits-affine", "mxfp4"],
)
def test_quantized_experts_equal_dequantized_experts(specs: dict) -> None:
    """Per-projection specs (mixed-bit recipes give down_proj more bits) and the fp modes
    without biases: QuantizedSwitchExperts == SwitchExperts holding the dequantized
    weights, on 40 tokens x top-3 with every expert hit."""
    num_experts, hidden, intermediate = 8, 128, 64
    dense = SwitchExperts(num_experts, hidden, intermediate)
    spec_dicts = {
        p: dict(zip(("group_size", "bits", "mode"), s, strict=True)) for p, s in specs.items()
    }
    packed = QuantizedSwitchExperts(num_experts, hidden, intermediate, spec_dicts)
    for name, spec in spec_dicts.items():
        weight = mx.random.normal(dense[name].shape, key=mx.random.key(len(name))) * 0.1
        quantized = mx.quantize(weight, **spec)  # (packed, scales[, biases])
        dense[name] = mx.dequantize(*quantized, **spec)
        for attr, value in zip(("weight", "scales", "biases"), quantized, strict=False):
            packed[name][attr] = value
    x = mx.random.normal((40, hidden), key=mx.random.key(1))
    indices = mx.argsort(mx.random.uniform(shape=(40, num_experts), key=mx.random.key(2)))[:, :3]
    ours, ref = packed(x, indices), dense(x, indices)
    assert ours.shape == (40, 3, hidden)
    assert mx.abs(ours - ref).max().item() <= 1e-4 * mx.abs(ref).max().item()


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_sorted_and_broadcast_expert_rows_agree(
    monkeypatch: pytest.MonkeyPatch, quantized: bool, tokens: int
) -> None:
    """The two gathers of _switch_glu (rows sorted by expert, from SORT_MIN_ROWS rows; each
    token broadcast over its k experts, below it) give the same [N, k, H], for dense and
    packed experts, whichever one the row count would pick."""
    import deltaserve.models.layers as layers

    num_experts, hidden, intermediate, k = 8, 128, 64, 3
    spec = {"group_size": 64, "bits": 4, "mode": "affine"}
    if quantized:
        experts = QuantizedSwitchExperts(
            num_experts,
            hidden,
            intermediate,
            dict.fromkeys(("gate_proj", "up_proj", "down_proj"), spec),
        )
    else:
        experts = SwitchExperts(num_experts, hidden, intermediate)
    for name in ("gate_proj", "up_proj", "down_proj"):
        shape = (
            (num_experts, hidden, intermediate)
            if name == "down_proj"
            else (num_experts, intermediate, hidden)
        )
        weight = mx.random.normal(shape, key=mx.random.key(len(name))) * 0.1
        if quantized:
            for attr, value in zip(
                ("weight", "scales", "biases"), mx.quantize(weight, **spec), strict=True
            ):
                experts[name][attr] = value
        else:
            experts[name] = weight
    x = mx.random.normal((tokens, hidden), key=mx.random.key(1))
    scores = mx.random.uniform(shape=(tokens, num_experts), key=mx.random.key(2))
    indices = mx.argsort(scores)[:, :k].astype(mx.uint32)
    monkeypatch.setattr(layers, "SORT_MIN_ROWS", 0)
    sorted_out = experts(x, indices)
    monkeypatch.setattr(layers, "SORT_MIN_ROWS", 10**9)
    broadcast_out = experts(x, indices)
    assert sorted_out.shape == broadcast_out.shape == (tokens, k, hidden)
    ref = mx.abs(sorted_out).max().item()
    assert mx.abs(sorted_out - broadcast_out).max().item() <= 1e-5 * ref


def test_sorted_rows_without_the_sorted_hint_give_the_same_experts_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where gather_mm's sorted path is wrong (mlx-cuda: layers.sorted_gather_mm_ok), the
    rows are still sorted by expert but the hint is withheld: the same [N, k, H] as with it
    (on the CPU, where both are right), and as each row's own matmuls."""
    import deltaserve.models.layers as layers

    num_experts, hidden, intermediate, k, tokens = 8, 64, 32, 3, 20
    experts = SwitchExperts(num_experts, hidden, intermediate)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        shape = (num_experts, hidden, intermediate) if name == "down_proj" else (
            num_experts, intermediate, hidden)  # fmt: skip
        experts[name] = mx.random.normal(shape, key=mx.random.key(10 + i)) * 0.1
    x = mx.random.normal((tokens, hidden), key=mx.random.key(1))
    scores = mx.random.uniform(shape=(tokens, num_experts), key=mx.random.key(2))
    indices = mx.argsort(scores)[:, :k].astype(mx.uint32)
    monkeypatch.setattr(layers, "SORT_MIN_ROWS", 0)
    hinted = experts(x, indices)
    monkeypatch.setattr(layers, "sorted_gather_mm_ok", lambda: False)
    unhinted = experts(x, indices)
    t, j = 7, 2  # one (token, expert) row by plain matmuls
    e = indices[t, j].item()
    gate, up = x[t] @ experts.gate_proj[e].T, x[t] @ experts.up_proj[e].T
    row = (gate * mx.sigmoid(gate) * up) @ experts.down_proj[e].T
    assert mx.allclose(unhinted, hinted, atol=1e-5).item()
    assert mx.allclose(unhinted[t, j], row, atol=1e-4).item()
