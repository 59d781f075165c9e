"""Load Qwen3.5 checkpoints (HF originals and mlx-community conversions) into one naming.

Internal names are the HF text-model names without the `model.language_model.` prefix
(`layers.3.self_attn.q_proj.weight`, ...), with three normalisations:
- conv1d weights are [C, K] (HF stores [C, 1, K], mlx-community [C, K, 1]);
- MoE experts are `mlp.experts.{gate,up,down}_proj` stacked [E, out, in], whether the
  checkpoint fuses them (HF `gate_up_proj`), lists them per expert, or uses mlx-lm's
  `switch_mlp`;
- every zero-centred RMSNorm weight holds the full gain 1 + w in float32. HF stores w;
  mlx-community stores the gain already shifted (by mlx-lm, in bf16). The layout is told
  apart the way mlx-lm does it: an un-converted conv1d weight ([C, 1, K]) means HF.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from deltaserve.models.eos import resolve_eos_ids
from deltaserve.models.hub import CheckpointNotFoundError, resolve_checkpoint

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
# Internal names whose HF value w stands for the gain 1 + w (Qwen3_5RMSNorm), in the
# trunk and in the MTP head. linear_attn.norm (RMSNormGated) is a plain gain: no match.
ZERO_CENTRED_NORMS = re.compile(
    r"^norm\.weight$|(^|\.)(input_layernorm|post_attention_layernorm|q_norm|k_norm"
    r"|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$"
)
FLOAT32_SUFFIXES = (".A_log", ".dt_bias", "norm.weight")  # always float32
# Checkpoint prefix -> (section, internal prefix). Order matters: longest first.
_PREFIXES = [
    ("model.language_model.", "text", ""),
    ("language_model.model.", "text", ""),
    ("language_model.lm_head.", "text", "lm_head."),
    ("lm_head.", "text", "lm_head."),
    ("model.visual.", "vision", ""),
    ("vision_tower.", "vision", ""),
    ("model.mtp.", "mtp", ""),
    ("language_model.mtp.", "mtp", ""),
    ("mtp.", "mtp", ""),
    ("model.", "text", ""),  # text-only HF checkpoints (Qwen3_5ForCausalLM)
]
PROGRESS_BYTES = 1 << 30  # show a progress bar for checkpoints above 1 GiB


class CheckpointError(ValueError):
    """The checkpoint exists but cannot be used: unknown model type, missing tensors..."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: text weights in internal naming plus what rides along."""

    config: dict  # the text config, plus top-level token ids and `layer_types`
    weights: dict[str, mx.array]  # text weights, internal names
    # internal weight name ("mtp." + name for MTP weights) -> bits / group_size / mode;
    # only with keep_quantized. Scales/biases sit at scales_name(name) / biases_name(name).
    quantization: dict[str, dict] | None
    vision_weights: dict[str, mx.array] = field(default_factory=dict)  # `model.visual.` dropped
    mtp_weights: dict[str, mx.array] = field(default_factory=dict)  # `mtp.` dropped, same rules
    path: Path = field(default_factory=Path)


def scales_name(weight_name: str) -> str:
    """Where a quantized weight's scales live: `X.weight` -> `X.scales`, `X` -> `X.scales`."""
    return weight_name.removesuffix(".weight") + ".scales"


def biases_name(weight_name: str) -> str:
    """Where a quantized weight's biases live (absent for the mx/nv fp formats)."""
    return weight_name.removesuffix(".weight") + ".biases"


def load_checkpoint(
    path_or_id: str | Path,
    compute_dtype: mx.Dtype | None = None,
    keep_quantized: bool = False,
    transform: Callable[[dict[str, mx.array], dict | None], None] | None = None,
) -> Checkpoint:
    """Load a Qwen3.5 checkpoint directory (or hub id) into internal naming.

    compute_dtype casts every floating weight (None keeps the stored dtype), except
    A_log, dt_bias and all norm weights, which are float32 always. Quantized
    mlx-community weights are dequantized into compute_dtype unless keep_quantized, in
    which case the (weight, scales, biases) triples are kept and described in
    `Checkpoint.quantization`.

    transform(weights, quantization) edits the converted text weights in place before
    anything is read (models/parallel.shard_weights keeps one rank's slices); the MTP
    head is then dropped (it is not sharded).
    """
    path = resolve_checkpoint(str(path_or_id))
    raw_config = _read_json(path / "config.json")
    config = text_config(raw_config, path)
    config["eos_token_id"] = list(resolve_eos_ids(path, raw_config))
    files = _weight_files(path)
    sections = _split_sections({k: v for f in files for k, v in mx.load(str(f)).items()})
    quant = _quantization_params(raw_config)
    ctx = _Context(_is_hf_layout(sections["text"]), compute_dtype, keep_quantized, quant)
    weights = ctx.convert(sections.pop("text"))
    if config.get("tie_word_embeddings"):
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    _check_names(weights, config)
    mtp = ctx.convert(sections.pop("mtp"), quant_prefix="mtp.")
    if transform is not None:
        transform(weights, ctx.quantization if keep_quantized else None)
        mtp = {}
    vision = {k: _cast(v, compute_dtype) for k, v in sections.pop("vision").items()}
    show_progress = sum(f.stat().st_size for f in files) >= PROGRESS_BYTES
    _materialize([weights, mtp, vision], show_progress)
    return Checkpoint(
        config, weights, ctx.quantization if keep_quantized else None, vision, mtp, path
    )


def _materialize(groups: list[dict[str, mx.array]], show_progress: bool) -> None:
    """Evaluate the lazily loaded, converted tensors a batch at a time.

    mx.load is lazy and nothing else holds the source arrays any more, so each batch
    reads its bytes, converts them and frees the sources: peak memory stays near the
    size of the result instead of source + result.
    """
    arrays = [value for group in groups for value in group.values()]
    bar = tqdm(total=len(arrays), desc="loading weights", unit="tensor", disable=not show_progress)
    with bar:
        for start in range(0, len(arrays), 32):
            mx.eval(arrays[start : start + 32])
            bar.update(len(arrays[start : start + 32]))


# --------------------------------------------------------------------------- config


def text_config(raw: dict, path: Path | str = "") -> dict:
    """The text config of a (composite or text-only) Qwen3.5 config.json.

    Top-level token ids and tie_word_embeddings fill in what the text config lacks,
    and `layer_types` is always present (derived from full_attention_interval if absent).
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: unsupported model_type {model_type!r}; this loader reads "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config = dict(raw.get("text_config") or raw)
    for key, value in raw.items():
        if key.endswith(("token_id", "token_ids")) or key == "tie_word_embeddings":
            config.setdefault(key, value)
    layers = int(config["num_hidden_layers"])
    if not config.get("layer_types"):
        interval = int(config.get("full_attention_interval", 4))
        config["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    if len(config["layer_types"]) != layers:
        raise CheckpointError(f"{path}: layer_types has {len(config['layer_types'])} entries")
    return config


def _quantization_params(raw: dict) -> dict | None:
    quant = raw.get("quantization")
    if quant is None:
        hf_quant = raw.get("quantization_config")
        if hf_quant and "bits" not in hf_quant:  # GPTQ, AWQ, FP8...: not an MLX layout
            method = hf_quant.get("quant_method", "unknown")
            raise CheckpointError(f"unsupported quantization method {method!r}")
        quant = hf_quant
    return quant


def expected_weight_names(config: dict) -> list[str]:
    """Every internal text weight name a checkpoint with this text config must provide."""
    names = ["embed_tokens.weight", "norm.weight"]
    if not config.get("tie_word_embeddings"):
        names.append("lm_head.weight")
    moe = config.get("num_experts", 0) > 0
    for i, kind in enumerate(config["layer_types"]):
        pre = f"layers.{i}."
        names += [pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"]
        if kind == "linear_attention":
            la = pre + "linear_attn."
            names += [la + p + ".weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b")]
            names += [la + p + ".weight" for p in ("in_proj_a", "out_proj", "conv1d", "norm")]
            names += [la + "A_log", la + "dt_bias"]
        else:
            sa = pre + "self_attn."
            names += [sa + p + ".weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            names += [sa + "q_norm.weight", sa + "k_norm.weight"]
        if moe:
            mlp = pre + "mlp."
            names += [mlp + "gate.weight", mlp + "shared_expert_gate.weight"]
            names += [mlp + "experts." + p for p in ("gate_proj", "up_proj", "down_proj")]
            names += [mlp + "shared_expert." + p + ".weight" for p in ("gate_proj", "up_proj")]
            names.append(mlp + "shared_expert.down_proj.weight")
        else:
            names += [pre + "mlp." + p + ".weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def _check_names(weights: dict[str, mx.array], config: dict) -> None:
    expected = expected_weight_names(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} text tensors, e.g. {', '.join(missing[:5])}"
        )
    known = set(expected)
    extra = [k for k in weights if k not in known and not k.endswith((".scales", ".biases"))]
    if extra:
        logger.warning("ignoring %d unexpected text tensors, e.g. %s", len(extra), extra[:5])
        for name in extra:
            del weights[name]


# --------------------------------------------------------------------------- files


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path} not found: not a checkpoint directory")
    return json.loads(path.read_text())


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [path / shard for shard in shards]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{path}: index names missing shard files {absent[:5]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    return files


def _split_sections(tensors: dict[str, mx.array]) -> dict[str, dict[str, mx.array]]:
    """Text / vision / mtp tensors with their checkpoint prefixes replaced."""
    sections: dict[str, dict[str, mx.array]] = {"text": {}, "vision": {}, "mtp": {}}
    for key, value in tensors.items():
        for prefix, section, internal in _PREFIXES:
            if key.startswith(prefix):
                sections[section][internal + key[len(prefix) :]] = value
                break
        else:
            sections["text"][key] = value  # reported as unexpected by _check_names
    return sections


def _is_hf_layout(text: dict[str, mx.array]) -> bool:
    """HF originals keep conv1d as [C, 1, K]; mlx-lm's conversion moves it to [C, K, 1]."""
    convs = [v for k, v in text.items() if k.endswith("conv1d.weight")]
    if not convs:
        raise CheckpointError("no linear_attn.conv1d weights: not a Qwen3.5 checkpoint")
    return convs[0].ndim == 3 and convs[0].shape[-1] != 1


def _cast(value: mx.array, dtype: mx.Dtype | None) -> mx.array:
    if dtype is None or not mx.issubdtype(value.dtype, mx.floating):
        return value
    return value.astype(dtype)


# --------------------------------------------------------------------------- conversion

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class _Context:
    """Per-tensor conversion rules for one checkpoint (its layout and the target dtype)."""

    shift_norms: bool  # HF layout: zero-centred norm weights need + 1
    dtype: mx.Dtype | None
    keep_quantized: bool
    quant: dict | None  # the checkpoint's `quantization` config section
    quantization: dict[str, dict] = field(default_factory=dict)

    def convert(self, tensors: dict[str, mx.array], quant_prefix: str = "") -> dict[str, mx.array]:
        """Rename, reshape, dequantize and cast every tensor of one section.

        Kept quantized weights are recorded in `self.quantization` as quant_prefix + name.
        """
        out: dict[str, mx.array] = {}
        experts: dict[tuple[str, str], dict[int, mx.array]] = {}
        for key, value in tensors.items():
            if key.endswith((".scales", ".biases")):
                continue  # consumed with their packed weight
            if f"{key.removesuffix('.weight')}.scales" in tensors:
                out.update(self._quantized(key, value, tensors, quant_prefix))
            elif match := _EXPERT.match(key):
                slot = (match[1], match[3])
                experts.setdefault(slot, {})[int(match[2])] = value
            elif key.endswith("mlp.experts.gate_up_proj"):
                gate, up = mx.split(value, 2, axis=-2)  # gate rows first, then up
                base = key.removesuffix("gate_up_proj")
                out[base + "gate_proj"], out[base + "up_proj"] = self._cast(gate), self._cast(up)
            else:
                out[_internal_name(key)] = self._plain(key, value)
        for (base, proj), by_index in experts.items():
            stacked = mx.stack([by_index[e] for e in sorted(by_index)])
            out[f"{base}.experts.{proj}"] = self._cast(stacked)
        return out

    def _plain(self, key: str, value: mx.array) -> mx.array:
        if key.endswith("conv1d.weight") and value.ndim == 3:
            return self._cast(value.reshape(value.shape[0], -1))  # [C,1,K] or [C,K,1] -> [C,K]
        if ZERO_CENTRED_NORMS.search(key):
            gain = value.astype(mx.float32)
            return gain + 1.0 if self.shift_norms else gain  # + 1 in float32, never twice
        if key.endswith(FLOAT32_SUFFIXES):
            return value.astype(mx.float32)
        return self._cast(value)

    def _cast(self, value: mx.array) -> mx.array:
        return _cast(value, self.dtype)

    def _quantized(
        self, key: str, packed: mx.array, tensors: dict[str, mx.array], quant_prefix: str
    ) -> dict[str, mx.array]:
        """One mlx (weight, scales, biases) triple, dequantized or kept."""
        module = key.removesuffix(".weight")
        scales, biases = tensors[module + ".scales"], tensors.get(module + ".biases")
        params = self._params(module, packed, scales)
        name = _internal_name(key)
        if not self.keep_quantized:
            scales, biases = self._cast(scales), biases if biases is None else self._cast(biases)
            return {name: mx.dequantize(packed, scales, biases, **params)}
        self.quantization[quant_prefix + name] = params
        kept = {name: packed, scales_name(name): self._cast(scales)}
        if biases is not None:
            kept[biases_name(name)] = self._cast(biases)
        return kept

    def _params(self, module: str, packed: mx.array, scales: mx.array) -> dict:
        if not self.quant:
            raise CheckpointError(f"{module} is quantized but config.json has no quantization")
        override = self.quant.get(_checkpoint_module(module, self.quant))
        source = override if isinstance(override, dict) else self.quant
        params = {
            "group_size": int(source["group_size"]),
            "bits": int(source["bits"]),
            "mode": source.get("mode", "affine"),
        }
        columns = packed.shape[-1] * 32 // params["bits"]
        if columns != scales.shape[-1] * params["group_size"]:
            raise CheckpointError(f"{module}: packed shape {packed.shape} disagrees with {params}")
        return params


def _internal_name(key: str) -> str:
    """mlx-lm's `switch_mlp.{p}.weight` -> `experts.{p}`; other names are unchanged."""
    if ".mlp.switch_mlp." in key:
        return key.replace(".mlp.switch_mlp.", ".mlp.experts.").removesuffix(".weight")
    return key


def _checkpoint_module(module: str, quant: dict) -> str:
    """The config key of a per-module override: mlx-lm's full module path."""
    for prefix in ("language_model.model.", "model.language_model.", "model.", ""):
        if prefix + module in quant:
            return prefix + module
    if module.startswith("lm_head"):
        return "language_model." + module
    return module
