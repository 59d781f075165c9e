"""The compiled DeltaNet prefill core (models/deltanet.py, the GPU default) gives the plain
path's results on the CPU, bit for bit: model logits and row state for fresh, continued and
left-padded chunks, and the engine's greedy tokens with batched prefill and compiled decode.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from parity_utils import forward, long_ids

from engine.cache.batch import BatchState
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.types import SamplingParams
from models.build import LoadedModel, load_model
from models.deltanet import GatedDeltaNet, deltanet_core
from models.testing import cached_checkpoint


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


def _set_compiled(loaded: LoadedModel, enabled: bool) -> None:
    for layer in loaded.model.layers:
        if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
            layer.linear_attn.compile_prefill = enabled


def _state_arrays(state: BatchState) -> list[mx.array]:
    return [a for layer in state.layers for a in layer.state_arrays()]


def _run(loaded: LoadedModel, enabled: bool) -> tuple[list[mx.array], list[mx.array]]:
    """Logits of a fresh 70-token chunk (two DeltaNet chunks), a continued 33-token chunk
    and a left-padded [3, 40] group of fresh rows; plus every state array afterwards."""
    _set_compiled(loaded, enabled)
    ids = long_ids(140)
    one = BatchState.empty(loaded.config)
    logits = [forward(loaded, one, [ids[:70]], [0]), forward(loaded, one, [ids[70:103]], [70])]
    rows = [ids[:40], ids[50:75], ids[100:101]]
    pads = tuple(40 - len(r) for r in rows)
    padded = [[11] * p + r for p, r in zip(pads, rows, strict=True)]
    three = BatchState.empty(loaded.config)
    offsets = [-p for p in pads]
    logits.append(forward(loaded, three, padded, offsets, pads))
    states = _state_arrays(one) + _state_arrays(three)
    mx.eval(logits, states)
    _set_compiled(loaded, None)
    return logits, states


def test_compiled_core_equals_plain_model(loaded: LoadedModel) -> None:
    plain_logits, plain_states = _run(loaded, False)
    comp_logits, comp_states = _run(loaded, True)
    for a, b in zip(plain_logits + plain_states, comp_logits + comp_states, strict=True):
        assert a.shape == b.shape
        assert mx.array_equal(a, b).item()


def test_core_outputs_shapes_and_masked_rows() -> None:
    """deltanet_core on random inputs: a row whose tokens are all masked keeps its state."""
    from models.deltanet import CoreDims

    dims = CoreDims(2, 16, 4, 16, 1e-6)
    conv_dim = 2 * 2 * 16 + 4 * 16
    keys = mx.random.split(mx.random.key(1), 6)
    b, length = 2, 9
    qkv = mx.random.normal((b, length, conv_dim), key=keys[0])
    z = mx.random.normal((b, length, 64), key=keys[1])
    beta_in, a_in = (mx.random.normal((b, length, 4), key=k) for k in keys[2:4])
    conv_state = mx.random.normal((b, 3, conv_dim), key=keys[4])
    ssm = mx.random.normal((b, 4, 16, 16), key=keys[5])
    weights = (mx.ones((conv_dim, 4)) * 0.3, mx.zeros((4,)), mx.zeros((4,)), mx.ones((16,)))
    mask = mx.array([[True] * length, [False] * length])
    pad = mx.array([0, length], dtype=mx.int32)
    args = (qkv, z, beta_in, a_in, conv_state, ssm, *weights, mask, pad)
    y, conv, s = deltanet_core(dims, *args)
    yc, convc, sc = mx.compile(lambda *a: deltanet_core(dims, *a))(*args)
    assert y.shape == (b, length, 64) and conv.shape == (b, 3, conv_dim)
    assert mx.array_equal(s[1], ssm[1]).item() and mx.array_equal(conv[1], conv_state[1]).item()
    for plain, comp in ((y, yc), (conv, convc), (s, sc)):
        assert mx.array_equal(plain, comp).item()


def test_engine_tokens_with_compiled_prefill(loaded: LoadedModel) -> None:
    """Greedy tokens of 10 prompts through the engine (batched prefill, compiled decode)
    are the same with the compiled prefill core on and off."""
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=96, max_prefill_chunk=40, batch_prefill=True
    )
    ids = long_ids(200)
    prompts = [tuple(ids[i * 7 : i * 7 + 20 + 9 * i]) for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    runs = []
    for enabled in (False, True):
        _set_compiled(loaded, enabled)
        engine = LLMEngine(loaded, dataclasses.replace(config, compile_decode=True))
        runs.append([c.token_ids for c in engine.generate(list(prompts), params)])
    _set_compiled(loaded, None)
    assert runs[0] == runs[1]
