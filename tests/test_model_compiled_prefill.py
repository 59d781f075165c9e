"""The compiled DeltaNet prefill (models/deltanet.py, the GPU default), run on the CPU:
the compiled core equals the plain one bit for bit; the model path that merges every
prefill group of a step into one bucketed, left-padded call per DeltaNet layer matches
each group run alone (same float32 math, other chunk boundaries: logits within REL_TOL,
states close), and the engine's greedy tokens do not change."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from parity_utils import long_ids, rel_error

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.deltanet import (
    CoreDims,
    GatedDeltaNet,
    deltanet_core,
    prefill_buckets,
    shifted_conv_input,
)
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint

# As tests/test_model_incremental.py: float32 in another order measures ~1e-6 .. 6e-6;
# a state bug (a pad leaking, a lost conv tail) moves logits by O(1e-2 .. 1).
REL_TOL = 5e-5


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


def _set_compiled(loaded: LoadedModel, enabled: bool | None) -> None:
    for layer in loaded.model.layers:
        if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
            layer.linear_attn.compile_prefill = enabled


def _group(rows: list[list[int]], offsets: list[int], state: BatchState, pads=None):
    tokens = mx.array(rows, dtype=mx.int32)
    return ForwardGroup(tokens, text_positions(offsets, tokens.shape[1]), state.layers, pads)


def _step(loaded: LoadedModel, enabled: bool, together: bool) -> tuple[list, list]:
    """A continuing 33-token chunk (after a 70-token one), a left-padded [3, 40] cohort of
    fresh rows and a fresh 5-token row: as one forward of three groups or one forward
    each. Returns the logits of every group and every state array afterwards."""
    _set_compiled(loaded, enabled)
    ids = long_ids(140)
    cont, cohort, short = (BatchState.empty(loaded.config) for _ in range(3))
    loaded.model([_group([ids[:70]], [0], cont)])
    rows = [ids[:40], ids[50:75], ids[100:101]]
    pads = tuple(40 - len(r) for r in rows)
    padded = [[11] * p + r for p, r in zip(pads, rows, strict=True)]
    groups = [
        _group([ids[70:103]], [70], cont),
        _group(padded, [-p for p in pads], cohort, pads),
        _group([ids[7:12]], [0], short),
    ]
    hidden = loaded.model(groups) if together else [loaded.model([g])[0] for g in groups]
    logits = [loaded.model.logits(h) for h in hidden]
    states = [a for s in (cont, cohort, short) for layer in s.layers for a in layer.state_arrays()]
    mx.eval(logits, states)
    _set_compiled(loaded, None)
    return logits, states


@pytest.mark.parametrize("together", [False, True])
def test_merged_bucketed_prefill_equals_plain(loaded: LoadedModel, together: bool) -> None:
    plain_logits, plain_states = _step(loaded, False, together=False)
    logits, states = _step(loaded, True, together)
    for ours, ref in zip(logits, plain_logits, strict=True):
        assert rel_error(ours, ref) <= REL_TOL
    for ours, ref in zip(states, plain_states, strict=True):
        assert ours.shape == ref.shape
        assert mx.allclose(ours.astype(mx.float32), ref.astype(mx.float32), 1e-4, 1e-4).item()


def test_buckets() -> None:
    assert prefill_buckets(1, 1) == (1, 16)
    assert prefill_buckets(3, 17) == (4, 32)
    assert prefill_buckets(16, 64) == (16, 64)
    assert prefill_buckets(19, 65) == (32, 128)
    assert prefill_buckets(64, 512) == (64, 512)


DIMS = CoreDims(2, 16, 4, 16, 1e-6)  # 2 key heads of 16, 4 value heads of 16
CONV_DIM = 2 * 2 * 16 + 4 * 16


def _core_inputs(seed: int, b: int, length: int) -> tuple[mx.array, ...]:
    """deltanet_core's projection inputs (qkv, z, beta_in, a_in) at DIMS, random."""
    keys = mx.random.split(mx.random.key(seed), 4)
    qkv = mx.random.normal((b, length, CONV_DIM), key=keys[0])
    z = mx.random.normal((b, length, 64), key=keys[1])
    beta_in, a_in = (mx.random.normal((b, length, 4), key=k) for k in keys[2:4])
    return qkv, z, beta_in, a_in


# deltanet_core's weights at DIMS: conv taps, A_log, dt_bias, the gated norm's weight
WEIGHTS = (mx.ones((CONV_DIM, 4)) * 0.3, mx.zeros((4,)), mx.zeros((4,)), mx.ones((16,)))


def test_compiled_core_equals_plain_core_with_masked_rows() -> None:
    """deltanet_core compiled == plain bit for bit; an all-masked row keeps its state."""
    b, length = 2, 9
    keys = mx.random.split(mx.random.key(11), 2)
    conv_state = mx.random.normal((b, 3, CONV_DIM), key=keys[0])
    ssm = mx.random.normal((b, 4, 16, 16), key=keys[1])
    mask = mx.array([[True] * length, [False] * length])
    pad = mx.array([0, length], dtype=mx.int32)
    args = (*_core_inputs(1, b, length), conv_state, ssm, *WEIGHTS, mask, pad)
    y, conv, s = deltanet_core(DIMS, *args)
    yc, convc, sc = mx.compile(lambda *a: deltanet_core(DIMS, *a))(*args)
    assert y.shape == (b, length, 64) and conv.shape == (b, 3, CONV_DIM)
    assert mx.array_equal(s[1], ssm[1]).item() and mx.array_equal(conv[1], conv_state[1]).item()
    for plain, comp in ((y, yc), (conv, convc), (s, sc)):
        assert mx.array_equal(plain, comp).item()


def test_fresh_rows_skip_the_shift_with_the_same_result() -> None:
    """Rows with no history (a zero conv state): `fresh` leaves state and padding where
    they are, and the conv input and the core's outputs equal the shifting path's, for
    rows of every padding (none, some, all but one column, all)."""
    b, length = 4, 7
    inputs = _core_inputs(2, b, length)
    conv_state = mx.zeros((b, 3, CONV_DIM))
    pad = mx.array([0, 2, length - 1, length], dtype=mx.int32)
    mask = mx.arange(length)[None] >= pad[:, None]
    moved = shifted_conv_input(conv_state, inputs[0], mask, pad)
    assert mx.array_equal(shifted_conv_input(conv_state, inputs[0], mask, pad, fresh=True), moved)
    args = (*inputs, conv_state, mx.zeros((b, 4, 16, 16)), *WEIGHTS, mask, pad)
    outputs = deltanet_core(DIMS, *args), deltanet_core(DIMS, *args, fresh=True)
    for plain, fresh in zip(*outputs, strict=True):
        assert mx.array_equal(plain, fresh).item()


def test_engine_tokens_with_compiled_prefill(loaded: LoadedModel) -> None:
    """Greedy tokens of 10 prompts through the engine (batched prefill, compiled decode:
    the GPU defaults) are the same with the compiled, merged prefill on and off."""
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
