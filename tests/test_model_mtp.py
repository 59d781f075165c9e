"""The MTP head (models/mtp.py) and the verify forward's DeltaNet state slots.

Neither transformers 5.24 nor mlx-lm 0.32.2 implements Qwen3.5's MTP head (both drop the
mtp.* tensors on load), so the dense head is checked against a plain re-derivation in
this file, written from the raw HF tensors and vLLM's qwen3_next_mtp math (embedding
first in the fc input, post-norm trunk hidden, the pair (h_t, x_{t+1}) at position t,
chained drafts feed the head's normed output). The MoE head shares every module with the
trunk's MoE layers: it is checked for loading and for chunking invariance.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest
from parity_utils import long_ids
from spec_utils import prefill, run

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import FullPrecisionKV
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.mtp import MTPHead, draft
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint

# Relative error bound against the re-derivation: same float32 math in another order
# (measured ~1e-6); a wrong norm gain, cat order or position moves logits by O(1).
REL_TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


@pytest.fixture(scope="module")
def dense() -> LoadedModel:
    return load_model(str(cached_checkpoint("tiny")))


def _rel(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


# --------------------------------------------------------------------------- re-derivation


def _raw(name: str) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(cached_checkpoint(name).glob("*.safetensors")):
        out.update({k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()})
    return out


def _norm(x: mx.array, w: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)  # HF: gain 1 + w


def _rope(x: mx.array, pos: mx.array, rot: int, theta: float) -> mx.array:
    """Rotate-half over the first `rot` dims; x [heads, L, D], pos [L]."""
    inv = theta ** (-mx.arange(0, rot, 2, dtype=mx.float32) / rot)
    ang = pos[:, None].astype(mx.float32) * inv[None]
    cos, sin = mx.cos(mx.concatenate([ang, ang], -1)), mx.sin(mx.concatenate([ang, ang], -1))
    r, rest = x[..., :rot], x[..., rot:]
    half = mx.concatenate([-r[..., rot // 2 :], r[..., : rot // 2]], -1)
    return mx.concatenate([r * cos + half * sin, rest], -1)


def reference_head_logits(
    raw: dict[str, mx.array], cfg: dict, hidden: mx.array, tokens: list[int], pos: mx.array
) -> tuple[mx.array, mx.array]:
    """The dense MTP head over L pairs of one row from scratch: (logits [L, V], m [L, H])."""
    w = {k.removeprefix("mtp."): v for k, v in raw.items() if k.startswith("mtp.")}
    lw = {k.removeprefix("layers.0."): v for k, v in w.items() if k.startswith("layers.0.")}
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rot, theta = int(hd * 0.25), cfg["rope_parameters"]["rope_theta"]
    emb = raw["model.language_model.embed_tokens.weight"][mx.array(tokens)]
    x = (
        mx.concatenate(
            [
                _norm(emb, w["pre_fc_norm_embedding.weight"]),
                _norm(hidden, w["pre_fc_norm_hidden.weight"]),
            ],
            -1,
        )
        @ w["fc.weight"].T
    )
    n = x.shape[0]
    h = _norm(x, lw["input_layernorm.weight"])
    qg = (h @ lw["self_attn.q_proj.weight"].T).reshape(n, heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, -1)
    k = (h @ lw["self_attn.k_proj.weight"].T).reshape(n, kv, hd)
    v = (h @ lw["self_attn.v_proj.weight"].T).reshape(n, kv, hd).transpose(1, 0, 2)
    q = _rope(_norm(q, lw["self_attn.q_norm.weight"]).transpose(1, 0, 2), pos, rot, theta)
    k = _rope(_norm(k, lw["self_attn.k_norm.weight"]).transpose(1, 0, 2), pos, rot, theta)
    k, v = mx.repeat(k, heads // kv, axis=0), mx.repeat(v, heads // kv, axis=0)
    scores = (q @ k.transpose(0, 2, 1)) * hd**-0.5
    causal = mx.arange(n)[:, None] >= mx.arange(n)[None]
    probs = mx.softmax(mx.where(causal, scores, -mx.inf), axis=-1)
    attn = (probs @ v).transpose(1, 0, 2).reshape(n, -1) * mx.sigmoid(gate)
    x = x + attn @ lw["self_attn.o_proj.weight"].T
    h = _norm(x, lw["post_attention_layernorm.weight"])
    g, u = h @ lw["mlp.gate_proj.weight"].T, h @ lw["mlp.up_proj.weight"].T
    x = x + (g * mx.sigmoid(g) * u) @ lw["mlp.down_proj.weight"].T
    m = _norm(x, w["norm.weight"])
    return m @ raw["lm_head.weight"].T, m


def _trunk_pairs(loaded: LoadedModel, length: int) -> tuple[list[int], mx.array]:
    ids = long_ids(length + 1)
    _, hidden = prefill(loaded, [ids[:length]])
    return ids, hidden


def test_dense_head_matches_rederivation(dense: LoadedModel) -> None:
    """Over the prompt's pairs (h_t, x_{t+1}), the head's logits equal the re-derivation."""
    n = 24
    ids, hidden = _trunk_pairs(dense, n)
    head = dense.mtp
    assert isinstance(head, MTPHead)
    m = head(
        dense.model.embed_tokens(mx.array([ids[1 : n + 1]])), hidden,
        text_positions([0], n), FullPrecisionKV(),
    )  # fmt: skip
    raw, cfg = _raw("tiny"), dense.checkpoint.config
    ref_logits, _ = reference_head_logits(raw, cfg, hidden[0], ids[1 : n + 1], mx.arange(n))
    assert _rel(dense.model.logits(m)[0], ref_logits) < REL_TOL


def test_draft_chains_like_rederivation(dense: LoadedModel) -> None:
    """draft(): the first draft scores the last true pair; each later one the pair of the
    previous draft and the head's own normed output, one position further on."""
    n, k = 20, 3
    ids, hidden = _trunk_pairs(dense, n)
    drafts = draft(
        dense.model, dense.mtp, hidden, mx.array([ids[1 : n + 1]]), text_positions([0], n),
        FullPrecisionKV(), k,
    )  # fmt: skip
    raw, cfg = _raw("tiny"), dense.checkpoint.config
    seq_hidden, seq_tokens = hidden[0], ids[1 : n + 1]
    for i in range(k):
        logits, m = reference_head_logits(raw, cfg, seq_hidden, seq_tokens, mx.arange(n + i))
        assert _rel(drafts.logits[0, i], logits[-1]) < REL_TOL
        token = drafts.tokens[0, i].item()
        assert token == mx.argmax(logits[-1]).item()
        seq_hidden = mx.concatenate([seq_hidden, m[-1:]])
        seq_tokens = [*seq_tokens, token]


def test_head_chunking_invariant(loaded: LoadedModel) -> None:
    """Pairs fed as one chunk or as a chunk then single pairs give the same outputs (the
    head's KV appends), dense and MoE; quantized-free on the CPU."""
    n = 16
    ids, hidden = _trunk_pairs(loaded, n)
    embeds = loaded.model.embed_tokens(mx.array([ids[1 : n + 1]]))
    whole = loaded.mtp(embeds, hidden, text_positions([0], n), FullPrecisionKV())
    store, parts = FullPrecisionKV(), []
    parts.append(loaded.mtp(embeds[:, :12], hidden[:, :12], text_positions([0], 12), store))
    for t in range(12, n):
        parts.append(
            loaded.mtp(embeds[:, t : t + 1], hidden[:, t : t + 1], text_positions([t], 1), store)
        )
    assert _rel(mx.concatenate(parts, axis=1), whole) < REL_TOL


def test_missing_head_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """mlx-lm's conversion drops mtp.*: the model loads without a head and says so."""
    with caplog.at_level(logging.INFO, logger="deltaserve.models.mtp"):
        loaded = load_model(str(cached_checkpoint("tiny-mlx-4bit")))
    assert loaded.mtp is None
    assert any("no MTP head" in r.getMessage() for r in caplog.records)


def test_quantized_head_stays_quantized(dense: LoadedModel) -> None:
    """A head built from affine-quantized mtp.* tensors keeps packed matmuls (as the trunk
    on Metal/CUDA) and stays close to the float head."""
    from deltaserve.models.build import build_mtp_head
    from deltaserve.models.loader import Checkpoint, biases_name, scales_name

    weights = load_model_weights_mtp()
    quant, packed = {}, {}
    for name, value in weights.items():
        if name.endswith("proj.weight") or name == "fc.weight":
            q, s, b = mx.quantize(value, group_size=64, bits=8)
            packed[name], packed[scales_name(name)], packed[biases_name(name)] = q, s, b
            quant["mtp." + name] = {"group_size": 64, "bits": 8, "mode": "affine"}
        else:
            packed[name] = value
    ckpt = Checkpoint(dense.checkpoint.config, {}, quant, mtp_weights=packed)
    head = build_mtp_head(dense.config, ckpt)
    assert isinstance(head.fc, nn.QuantizedLinear)
    assert isinstance(head.layers[0].self_attn.o_proj, nn.QuantizedLinear)
    n = 8
    ids, hidden = _trunk_pairs(dense, n)
    embeds = dense.model.embed_tokens(mx.array([ids[1 : n + 1]]))
    pos = text_positions([0], n)
    got = head(embeds, hidden, pos, FullPrecisionKV())
    want = dense.mtp(embeds, hidden, pos, FullPrecisionKV())
    assert _rel(got, want) < 5e-2  # 8-bit weights


def load_model_weights_mtp() -> dict[str, mx.array]:
    """The tiny checkpoint's mtp.* tensors in internal naming (float32)."""
    from deltaserve.models.loader import load_checkpoint

    return load_checkpoint(cached_checkpoint("tiny"), mx.float32).mtp_weights


# --------------------------------------------------------------------------- verify slots


@pytest.mark.parametrize("fed", [1, 2, 4])
def test_verify_slots_equal_states_of_prefixes(loaded: LoadedModel, fed: int) -> None:
    """A verify forward of `fed` tokens per row (rows of different lengths) keeps, for each
    DeltaNet layer, slot i = the conv tail and state after feeding the first i + 1 tokens
    alone; the layer's state itself is the last slot."""
    prompts = [long_ids(30), long_ids(19)]
    chunk = [[11, 22, 33, 44][:fed], [55, 66, 77, 88][:fed]]
    state, _ = prefill(loaded, prompts)
    run(loaded, state, chunk, [30, 19], state_slots=True)
    for i in range(fed):
        ref, _ = prefill(loaded, prompts)
        run(loaded, ref, [c[: i + 1] for c in chunk], [30, 19])
        for got, want in zip(state.layers, ref.layers, strict=True):
            if isinstance(got, SSMState):
                conv, ssm = got.slots
                assert _rel(conv[:, i], want.conv) < REL_TOL
                assert _rel(ssm[:, i], want.ssm) < REL_TOL
    for layer in state.layers:
        if isinstance(layer, SSMState):
            assert mx.array_equal(layer.ssm, layer.slots[1][:, -1]).item()


def test_state_slots_need_unpadded_group() -> None:
    """A padded group cannot keep slots (its conv tails would mix padding in)."""
    with pytest.raises(ValueError, match="state_slots"):
        ForwardGroup(mx.zeros((2, 3), mx.int32), text_positions([0, 0], 3), [], (1, 0),
                     state_slots=True)  # fmt: skip


def test_fresh_batch_state_has_no_slots(dense: LoadedModel) -> None:
    """Slots are written only by a verify forward."""
    state = BatchState.empty(dense.config)
    run(dense, state, [[1, 2, 3]], [0])
    assert all(getattr(layer, "slots", None) is None for layer in state.layers)
