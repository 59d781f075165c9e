"""The Metal/CUDA loading path (weights kept quantized, QuantizedLinear matmuls), run on
the CPU by pretending the device is not the CPU: same logits as the dequantized CPU path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import deltaserve.models.build as build
from deltaserve.engine.cache.batch import BatchState
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint


def _logits(loaded: build.LoadedModel, tokens: mx.array) -> np.ndarray:
    states = BatchState.empty(loaded.config).layers
    positions = text_positions([0], tokens.shape[1])
    hidden = loaded.model([ForwardGroup(tokens, positions, states)])[0]
    return np.array(loaded.model.logits(hidden))


@pytest.mark.parametrize("name", ["tiny-mlx-4bit", "tiny-moe-mlx-4bit"])
def test_kept_quantized_matches_dequantized(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative logit error <= 1e-4: both paths use the same 4-bit values, only the matmul
    kernel differs (quantized_matmul / gather_qmm vs dequantize-then-BLAS); the kept path
    keeps MoE experts packed too (tests/test_model_quantized_moe.py goes further)."""
    path = str(cached_checkpoint(name))
    tokens = mx.array([[1, 2, 3, 248045, 77, 4000]])
    reference = _logits(build.load_model(path), tokens)
    monkeypatch.setattr(build, "on_cpu", lambda: False)
    kept = build.load_model(path, dtype=mx.float32)
    assert kept.quantized
    mlp = kept.model.layers[0].mlp
    assert type(mlp.gate if "moe" in name else mlp.gate_up_proj.proj).__name__ == "QuantizedLinear"
    if "moe" in name:
        assert type(mlp.experts).__name__ == "QuantizedSwitchExperts"
    ours = _logits(kept, tokens)
    assert np.abs(ours - reference).max() / np.abs(reference).max() <= 1e-4
