"""The direct mlx-community quantized writer (models/testing/quantized.py) against mlx-lm's
converter on the tiny shapes: same tensor names, shapes and dtypes, same config.json, the
same values for every unquantized tensor; dequantized projections have the plan's spread;
our loader keeps the experts packed on the GPU path and mlx-lm loads it too."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import deltaserve.models.build as build
from deltaserve.engine.cache.batch import BatchState
from deltaserve.models.layers import QuantizedSwitchExperts, SparseMoE
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint, tensor_plan, write_mlx_quantized
from deltaserve.models.testing.config import SHAPES


def _tensors(path: Path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.fixture(
    scope="module", params=[("tiny-moe", "tiny-moe-mlx-4bit"), ("tiny", "tiny-mlx-4bit")]
)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    shape, converted = request.param
    direct = write_mlx_quantized(tmp_path_factory.mktemp("direct") / "ckpt", shape, bits=4)
    return shape, direct, cached_checkpoint(converted)


def test_same_layout_and_config_as_the_converter(pair: tuple) -> None:
    _, direct, converted = pair
    ours, theirs = _tensors(direct), _tensors(converted)
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert (ours[name].shape, ours[name].dtype) == (value.shape, value.dtype), name
    assert json.loads((direct / "config.json").read_text()) == json.loads(
        (converted / "config.json").read_text()
    )


def test_unquantized_tensors_hold_the_converters_values(pair: tuple) -> None:
    _, direct, converted = pair
    ours, theirs = _tensors(direct), _tensors(converted)
    quantized = {n.removesuffix(".scales") for n in theirs if n.endswith(".scales")}
    plain = [n for n in theirs if n.removesuffix(".weight") not in quantized]
    plain = [n for n in plain if not n.endswith((".scales", ".biases"))]
    assert any("conv1d" in n for n in plain) and any("A_log" in n for n in plain)
    for name in plain:
        assert mx.array_equal(ours[name], theirs[name]).item(), name


def test_dequantized_projections_have_the_plans_spread(pair: tuple) -> None:
    shape, direct, _ = pair
    ours = _tensors(direct)
    stds = {s.name: s.std for s in tensor_plan(SHAPES[shape]) if s.std}
    name = "language_model.model.layers.0.linear_attn.in_proj_qkv"
    values = mx.dequantize(ours[f"{name}.weight"], ours[f"{name}.scales"], ours[f"{name}.biases"])
    want = stds["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"]
    values = np.array(values.astype(mx.float32))
    assert abs(values.mean()) < 0.05 * want and abs(values.std() / want - 1) < 0.05


def test_loads_with_packed_experts_and_runs(pair: tuple) -> None:
    shape, direct, _ = pair
    with pytest.MonkeyPatch.context() as patch:  # the Metal/CUDA path, here on the CPU
        patch.setattr(build, "on_cpu", lambda: False)
        loaded = build.load_model(str(direct), dtype=mx.float32)
    moe = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert bool(moe) == bool(SHAPES[shape].experts)
    assert all(type(m.experts) is QuantizedSwitchExperts for m in moe)
    tokens = mx.array([[1, 2, 3, 4000, 77]], dtype=mx.int32)
    states = BatchState.empty(loaded.config).layers
    hidden = loaded.model([ForwardGroup(tokens, text_positions([0], 5), states)])[0]
    assert mx.isfinite(loaded.model.logits(hidden)).all().item()


def test_mlx_lm_loads_it(pair: tuple) -> None:
    mlx_lm = pytest.importorskip("mlx_lm")
    _, direct, _ = pair
    model, _ = mlx_lm.load(str(direct))
    logits = model(mx.array([[1, 2, 3, 4000, 77]]))
    assert mx.isfinite(logits).all().item()
