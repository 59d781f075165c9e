"""engine/packed_step.py: the decode batch and fresh prompts through one packed forward,
each layer a compiled call of its kind's trace, give what the compiled decode step and
the compiled fresh-prompt forward give them apart (logits, last hidden states, every
layer's row state), for every KV kind, dense, MoE and 4-bit; one trace serves every layer of a
kind, and a decode batch held at its bucket (dead rows) is fine. On a GPU from
bench/gpu_session.sh's test list."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.factory import kv_store_factory
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.config import KVCacheConfig
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.packed_step import PackedMixedStep
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.state import ForwardGroup, LayerState, text_positions
from deltaserve.models.testing import cached_checkpoint

KINDS = {
    "fp": KVCacheConfig(),
    "affine8": KVCacheConfig(kind="affine", bits=8),
    "tq_k8v3": KVCacheConfig(kind="turboquant", key_bits=8, value_bits=3),
}
# The packed forward's matmuls run over both groups' rows at once, a block of another
# shape than either group's alone, for which the BLAS (or a GPU's kernels) may sum in
# another order: agreement as tests/test_compiled_prompt.py's, relative to the values'
# scale (logits of random weights reach ~40: one 1.5e-4 apart on this CPU).
TOL = 5e-4 if mx.default_device() == mx.cpu else 5e-3


# dense, MoE, and quantized (a Mac user's 4-bit: the packed weights, scales and biases
# are the traced layer's inputs like any weight)
@pytest.fixture(scope="module", params=["tiny", "tiny-moe", "tiny-moe-mlx-4bit"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)), dtype=mx.float32)


def _decoding(loaded: LoadedModel, kv: KVCacheConfig, lengths: list[int], dead: int) -> BatchState:
    """Rows prefilled eagerly (left-padded to the longest), plus `dead` rows held at the
    batch's bucket after them (state of zeros-length prompts: one padding token)."""
    state = BatchState.empty(loaded.config, kv_store_factory(kv))
    longest = max(lengths)
    lengths = lengths + [1] * dead
    ids = [[0] * (longest - n) + [100 + 7 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    pads = tuple(longest - n for n in lengths)
    positions = mx.maximum(text_positions([-p for p in pads], longest), 0)
    loaded.model([ForwardGroup(mx.array(ids, dtype=mx.int32), positions, state.layers, pads)])
    mx.eval(*state.state_arrays())
    return state


def _same_layer(got: LayerState, want: LayerState, quantized: bool) -> bool:
    """A layer's row state: float arrays by `_gap`, packed integer codes exactly. A
    quantized store's arrays may differ in under 1% of their bytes (codes) or elements
    (scales, biases, norms): a value on a quantization boundary rounded to the
    neighbouring level (as tests/test_compiled_prompt.py's `_close` says), or a group
    whose min and max are near equal in magnitude, whose affine bias MLX takes from the
    larger (seen on this CPU's OpenBLAS: one token's bias -0.0221 against 0.0221, an
    encoding as exact as the other)."""
    allowed = 0.01 if quantized else 0.0
    for g, w in zip(got.state_arrays(), want.state_arrays(), strict=True):
        if g.shape != w.shape:
            return False
        if mx.issubdtype(g.dtype, mx.integer):
            differ = np.array(g).view(np.uint8) != np.array(w).view(np.uint8)
        else:
            scale = max(1.0, float(mx.max(mx.abs(w))))
            differ = np.abs(np.array(g) - np.array(w)) > TOL * scale
        if float(np.mean(differ)) > allowed:
            return False
    return True


def _gap(got: mx.array, want: mx.array) -> float:
    """The largest difference, relative to the larger of 1 and the reference's largest
    magnitude."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    scale = max(1.0, float(mx.max(mx.abs(want))))
    return float(mx.max(mx.abs(got - want))) / scale


@pytest.mark.parametrize("kv", list(KINDS))
def test_packed_step_equals_the_compiled_forwards_apart(loaded: LoadedModel, kv: str) -> None:
    """Steps in a row with one or several prompt blocks (the second step replays the
    first's traces, the others trace new sets of shapes): decode logits, each block's
    hidden states and every row state equal the separate compiled forwards' (one
    compiled prompt call per block); the decode batch's dead row is carried."""
    model, config = loaded.model, KINDS[kv]
    lengths = [5, 9, 7]
    apart = _decoding(loaded, config, lengths, dead=1)
    packed_state = _decoding(loaded, config, lengths, dead=1)
    decode, prompts_fn = CompiledDecode(model), CompiledPrefill(model)
    packed = PackedMixedStep(model)
    fresh = BatchState.empty(loaded.config, kv_store_factory(config))
    assert packed.supports(packed_state, fresh, 2)
    steps = [
        ([[7], [8], [9]], [[list(range(300, 320)), list(range(400, 411))]]),
        ([[17], [18], [19]], [[list(range(500, 516)), list(range(600, 630))]]),
        ([[27], [28], [29]], [[list(range(700, 750))]]),
        ([[37], [38], [39]], [[list(range(800, 900))], [list(range(900, 905))] * 3]),
    ]
    offsets = list(lengths)
    for tokens, blocks in steps:
        ids = mx.array(tokens, dtype=mx.int32)
        want_logits = decode(ids, offsets, apart)
        want_runs = [prompts_fn(block, fresh) for block in blocks]
        logits, runs = packed(ids, offsets, packed_state, blocks, fresh)
        assert logits.shape == want_logits.shape and _gap(logits, want_logits) <= TOL
        got_rows, want_rows = [packed_state], [apart]
        for (hidden, states), (want_hidden, want_states) in zip(runs, want_runs, strict=True):
            assert hidden.shape == want_hidden.shape and _gap(hidden, want_hidden) <= TOL
            got_rows += states
            want_rows += want_states
        for got_row, want_row in zip(got_rows, want_rows, strict=True):
            for got, want in zip(got_row.layers, want_row.layers, strict=True):
                assert _same_layer(got, want, quantized=kv != "fp")
        offsets = [o + 1 for o in offsets]
    # the second step's prompts fall in the first's bucket: three sets of shapes ran
    assert len(packed.shapes) == 3, "(decode, store, prompt blocks) shapes that ran"


def test_one_trace_serves_every_layer_of_a_kind(loaded: LoadedModel) -> None:
    """Each layer kind's body is traced once per shape, whatever the number of layers of
    that kind (the layers' weights are the trace's inputs), and not again on a replay."""
    model = loaded.model
    traced: list[tuple[bool, bool]] = []
    original = PackedMixedStep._layer_body

    def counting(self: PackedMixedStep, kind: tuple[bool, bool]) -> Callable:
        body = original(self, kind)

        def wrapped(*args: mx.array) -> list[mx.array]:
            traced.append(kind)
            return body(*args)

        return wrapped

    PackedMixedStep._layer_body = counting
    try:
        packed = PackedMixedStep(model)
    finally:
        PackedMixedStep._layer_body = original
    state = _decoding(loaded, KINDS["fp"], [4, 6], dead=0)
    fresh = BatchState.empty(loaded.config)
    kinds = {
        (layer.is_full_attention, i == len(model.layers) - 1)
        for i, layer in enumerate(model.layers)
    }
    for step in range(2):
        ids = mx.array([[5 + step], [6 + step]], dtype=mx.int32)
        logits, _ = packed(ids, [4 + step, 6 + step], state, [[[300 + step] * 12]], fresh)
        mx.eval(logits)
        assert sorted(traced) == sorted(kinds), "one trace per kind, none on the replay"
    assert len(model.layers) > len(kinds)
