"""Checkpoint loading: HF and mlx-community layouts into one internal naming."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from deltaserve.models.eos import resolve_eos_ids
from deltaserve.models.hub import CheckpointNotFoundError
from deltaserve.models.loader import (
    Checkpoint,
    CheckpointError,
    biases_name,
    expected_weight_names,
    load_checkpoint,
    scales_name,
)
from deltaserve.models.testing import cached_checkpoint

GAINS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


def _load(name: str, dtype: mx.Dtype | None = mx.float32, **kwargs: bool) -> Checkpoint:
    return load_checkpoint(cached_checkpoint(name), dtype, **kwargs)


def _raw(name: str) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    for file in sorted(cached_checkpoint(name).glob("*.safetensors")):
        tensors.update(mx.load(str(file)))
    return tensors


def _rel_rms(a: mx.array, b: mx.array) -> float:
    return float(mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(b**2)))


@pytest.fixture(scope="module")
def dense() -> Checkpoint:
    return _load("tiny")


def test_hf_dense_names_shapes_dtypes(dense: Checkpoint) -> None:
    """Internal names are exactly the expected set; conv1d is [C, K]; all float32."""
    assert sorted(dense.weights) == sorted(expected_weight_names(dense.config))
    assert dense.weights["layers.0.linear_attn.conv1d.weight"].shape == (512, 4)
    assert dense.weights["lm_head.weight"].shape == (248320, 128)
    assert {v.dtype for v in dense.weights.values()} == {mx.float32}
    assert dense.quantization is None and dense.path == cached_checkpoint("tiny")
    assert dense.config["image_token_id"] == 248056 and dense.config["model_type"] == "qwen3_5_text"
    assert dense.config["layer_types"][3] == "full_attention"


def test_hf_norms_become_gains_in_float32(dense: Checkpoint) -> None:
    """Zero-centred norms (trunk and MTP) hold 1 + w; the gated DeltaNet norm is unshifted."""
    raw = _raw("tiny")
    lm = "model.language_model."
    for key in [
        "layers.0.input_layernorm.weight",
        "layers.3.self_attn.k_norm.weight",
        "norm.weight",
    ]:
        expected = raw[lm + key].astype(mx.float32) + 1.0
        assert mx.array_equal(dense.weights[key], expected).item(), key
    gated = raw[lm + "layers.0.linear_attn.norm.weight"].astype(mx.float32)
    assert mx.array_equal(dense.weights["layers.0.linear_attn.norm.weight"], gated).item()
    mtp_norm = raw["mtp.pre_fc_norm_hidden.weight"].astype(mx.float32) + 1.0
    assert mx.array_equal(dense.mtp_weights["pre_fc_norm_hidden.weight"], mtp_norm).item()


def test_vision_and_mtp_kept_apart(dense: Checkpoint) -> None:
    """model.visual.* and mtp.* are recognised, kept, and never among the text weights."""
    assert "patch_embed.proj.weight" in dense.vision_weights
    assert "fc.weight" in dense.mtp_weights
    assert "layers.0.self_attn.q_proj.weight" in dense.mtp_weights
    assert not any("visual" in k or k.startswith(("mtp", "fc.")) for k in dense.weights)


def test_compute_dtype_none_keeps_bf16_but_not_gains_or_decay() -> None:
    """Without compute_dtype weights stay bf16; gains, A_log and dt_bias are float32."""
    ckpt = _load("tiny", None)
    assert ckpt.weights["layers.0.mlp.up_proj.weight"].dtype == mx.bfloat16
    for key in ["layers.0.input_layernorm.weight", "layers.0.linear_attn.norm.weight",
                "layers.0.linear_attn.A_log", "layers.0.linear_attn.dt_bias"]:  # fmt: skip
        assert ckpt.weights[key].dtype == mx.float32, key


def test_tied_has_no_lm_head() -> None:
    """Tied checkpoints expose embeddings only."""
    ckpt = _load("tiny-tied")
    assert ckpt.config["tie_word_embeddings"] and "lm_head.weight" not in ckpt.weights


def test_sharded_equals_single(dense: Checkpoint) -> None:
    """An index + shards load to the same weights as one file."""
    sharded = _load("tiny-sharded")
    assert sharded.weights.keys() == dense.weights.keys()
    assert all(mx.array_equal(v, dense.weights[k]).item() for k, v in sharded.weights.items())


def test_moe_fused_and_per_expert_agree() -> None:
    """Fused gate_up_proj splits gate-first; per-expert keys stack to the same tensors."""
    fused, per_expert = _load("tiny-moe"), _load("tiny-moe-per-expert")
    assert fused.weights.keys() == per_expert.weights.keys()
    for key, value in fused.weights.items():
        assert mx.array_equal(value, per_expert.weights[key]).item(), key
    gate_up = _raw("tiny-moe")["model.language_model.layers.2.mlp.experts.gate_up_proj"]
    gate = fused.weights["layers.2.mlp.experts.gate_proj"]
    assert gate.shape == (8, 64, 128)
    assert fused.weights["layers.2.mlp.experts.down_proj"].shape == (8, 128, 64)
    assert mx.array_equal(gate, gate_up[:, :64].astype(mx.float32)).item()
    assert fused.weights["layers.2.mlp.shared_expert_gate.weight"].shape == (1, 128)
    assert "layers.0.mlp.experts.gate_proj" in fused.mtp_weights


@pytest.mark.parametrize(("name", "source", "tol"), [
    ("tiny-mlx-4bit", "tiny", 0.15),
    ("tiny-mlx-8bit", "tiny", 0.01),
    ("tiny-moe-mlx-4bit", "tiny-moe", 0.15),
])  # fmt: skip
def test_mlx_community_dequantized_matches_hf(name: str, source: str, tol: float) -> None:
    """mlx-lm conversions dequantize to the HF weights within quantization error."""
    mlx, hf = _load(name), _load(source)
    assert mlx.weights.keys() == hf.weights.keys()
    assert not mlx.vision_weights and not mlx.mtp_weights  # mlx-lm drops both
    for key, value in mlx.weights.items():
        reference = hf.weights[key]
        assert value.dtype == mx.float32 and value.shape == reference.shape, key
        if key.endswith("dt_bias"):  # mlx-lm's converter casts it to bf16 (A_log it spares)
            assert mx.allclose(value, reference, rtol=2.0**-8, atol=0).item(), key
        elif "norm" in key or key.endswith(("A_log", "conv1d.weight")):  # not quantized
            assert mx.array_equal(value, reference).item(), key
        else:
            assert _rel_rms(value, reference) < tol, key


def test_mlx_gains_not_shifted_twice() -> None:
    """Off-grid norm weights: mlx gains equal 1 + w up to bf16 rounding, never 2 + w."""
    mlx, hf = _load("tiny-inexact-mlx-8bit"), _load("tiny-inexact")
    diffs = [
        mx.abs(mlx.weights[k] - hf.weights[k]).max().item()
        for k in hf.weights
        if any(k.endswith(g + ".weight") for g in GAINS) or k == "norm.weight"
    ]
    assert len(diffs) == 8 * 2 + 2 * 2 + 1
    assert max(diffs) <= 2.0**-8 and max(diffs) > 0  # bf16 rounding of 1 + w, nothing more


def test_mlx_keep_quantized_triples() -> None:
    """keep_quantized keeps packed weights + scales/biases with per-layer bits."""
    kept = _load("tiny-moe-mlx-4bit", None, keep_quantized=True)
    quant = kept.quantization
    assert quant["layers.0.mlp.gate.weight"]["bits"] == 8  # mlx-lm's router override
    assert quant["layers.0.mlp.shared_expert_gate.weight"]["bits"] == 8
    assert quant["layers.0.mlp.experts.gate_proj"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }
    packed = kept.weights["layers.0.mlp.experts.gate_proj"]
    assert packed.dtype == mx.uint32 and packed.shape == (8, 64, 16)
    scales = kept.weights[scales_name("layers.0.mlp.experts.gate_proj")]
    biases = kept.weights[biases_name("layers.0.mlp.experts.gate_proj")]
    dequantized = _load("tiny-moe-mlx-4bit", None).weights["layers.0.mlp.experts.gate_proj"]
    assert mx.array_equal(mx.dequantize(packed, scales, biases, 64, 4), dequantized).item()


# --------------------------------------------------------------------------- errors


def _copy_with(tmp: Path, source: Path, config_edit: dict | None = None) -> Path:
    """A checkpoint dir whose weights are symlinks to `source`'s, config optionally edited."""
    tmp.mkdir()
    for file in source.iterdir():
        (tmp / file.name).symlink_to(file)
    if config_edit is not None:
        config = json.loads((source / "config.json").read_text())
        config.update(config_edit)
        (tmp / "config.json").unlink()
        (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def test_unknown_model_type_is_named(tmp_path: Path) -> None:
    """An unsupported model_type is refused by name."""
    path = _copy_with(tmp_path / "ckpt", cached_checkpoint("tiny"), {"model_type": "llama"})
    with pytest.raises(CheckpointError, match="'llama'"):
        load_checkpoint(path, mx.float32)


def test_foreign_quantization_is_refused(tmp_path: Path) -> None:
    """HF quantization methods (fp8, gptq...) are not silently treated as MLX ones."""
    edit = {"quantization_config": {"quant_method": "fp8"}}
    path = _copy_with(tmp_path / "ckpt", cached_checkpoint("tiny"), edit)
    with pytest.raises(CheckpointError, match="fp8"):
        load_checkpoint(path, mx.float32)


def test_missing_tensors_are_listed(tmp_path: Path) -> None:
    """Dropping a shard from the index reports the missing tensor names."""
    path = _copy_with(tmp_path / "ckpt", cached_checkpoint("tiny-sharded"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if v.startswith("model-00001")
    }
    (path / "model.safetensors.index.json").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing \d+ text tensors, e.g. .*layers\."):
        load_checkpoint(path, mx.float32)


def test_missing_local_path_is_named(tmp_path: Path) -> None:
    """A path that does not exist is reported as such, without a hub lookup."""
    with pytest.raises(CheckpointNotFoundError, match="does-not-exist"):
        load_checkpoint(str(tmp_path / "does-not-exist"), mx.float32)


def test_hub_id_offline_is_a_clear_error(tmp_path: Path) -> None:
    """With HF_HUB_OFFLINE=1 and an empty cache, a hub id fails naming the id."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = (
        "from deltaserve.models.loader import load_checkpoint\n"
        "try:\n    load_checkpoint('Qwen/Qwen3.5-0.8B')\n"
        "except FileNotFoundError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR checkpoint 'Qwen/Qwen3.5-0.8B'"), out.stdout
    assert "Hugging Face Hub" in out.stdout


def test_eos_ids_from_generation_config_first() -> None:
    """Published layout: config.json names <|endoftext|> only; generation_config.json adds
    <|im_end|>, and the loader hands the engine both."""
    path = cached_checkpoint("tiny")
    assert json.loads((path / "config.json").read_text())["text_config"]["eos_token_id"] == 248044
    assert resolve_eos_ids(path) == (248046, 248044)
    assert load_checkpoint(path, mx.float32).config["eos_token_id"] == [248046, 248044]


def test_eos_ids_fall_back_to_config_then_tokenizer(tmp_path: Path) -> None:
    """Without generation_config.json: config.json (top level and text_config), then the
    tokenizer's eos_token looked up among its added tokens."""
    src = cached_checkpoint("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    raw = {"text_config": {"eos_token_id": [7, 8]}, "eos_token_id": 9}
    assert resolve_eos_ids(tmp_path, raw) == (9, 7, 8)
    assert resolve_eos_ids(tmp_path, {}) == (248046,)  # tokenizer_config: <|im_end|>
