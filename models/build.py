"""Checkpoint -> ready Qwen35Model on the current MLX device."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from deltaserve.kernels.platform import current_platform, prepare_device
from deltaserve.models.config import TextConfig
from deltaserve.models.hub import resolve_checkpoint
from deltaserve.models.layers import EXPERT_PROJECTIONS, SparseMoE
from deltaserve.models.loader import Checkpoint, CheckpointError, biases_name, load_checkpoint
from deltaserve.models.mtp import MTPHead, log_missing_head
from deltaserve.models.parallel import TensorParallel, shard_config, shard_weights
from deltaserve.models.qwen35 import DecoderLayer, Qwen35Model
from deltaserve.models.vision import VisionConfig, VisionTower, load_vision


def on_cpu() -> bool:
    """True when MLX computes on the CPU (the platform profile: kernels/platform.py)."""
    return current_platform().is_cpu


@dataclass
class LoadedModel:
    """A built model plus what the engine and server need to know about it."""

    model: Qwen35Model = field(repr=False)
    config: TextConfig
    path: Path  # resolved local directory (tokenizer files live here)
    dtype: mx.Dtype  # activations / unquantized weights
    quantized: bool  # weights kept as MLX affine-quantized matmuls
    checkpoint: Checkpoint = field(repr=False)
    # The vision tower (in `dtype`) and its config; both None for a text-only checkpoint
    # (no vision_config, or a conversion that dropped the vision tensors).
    vision: VisionTower | None = field(default=None, repr=False)
    vision_config: VisionConfig | None = None
    # This process's place in a tensor-parallel group (None: the whole model here); then
    # `config` holds the per-rank sizes (models/parallel.shard_config)
    parallel: TensorParallel | None = None
    # The MTP head (models/mtp.py), built from the checkpoint's mtp.* tensors; None when
    # it has none or under tensor parallelism (the head is not sharded)
    mtp: MTPHead | None = field(default=None, repr=False)

    def weight_bytes(self) -> int:
        """Bytes of the language model's weights (what a decode step reads)."""
        return _parameter_bytes(self.model)

    def vision_weight_bytes(self) -> int:
        """Bytes of the vision tower's weights (resident too; 0 without a tower)."""
        return 0 if self.vision is None else _parameter_bytes(self.vision)


def _parameter_bytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in nn.utils.tree_flatten(module.parameters()))


def load_model(
    path_or_id: str, dtype: mx.Dtype | None = None, parallel: TensorParallel | None = None
) -> LoadedModel:
    """Load a Qwen3.5 checkpoint (local dir or hub id).

    On CPU: weights are upcast / dequantized to float32 (BLAS-backed f32 GEMM is an order
    of magnitude faster there than bf16 or quantized matmuls). On Metal/CUDA: checkpoint
    dtype and MLX quantized matmuls. `parallel`: keep only this rank's slices
    (models/parallel.py); quantized weights are cut in their packed form.
    """
    prepare_device(None)  # loading is MLX's first GPU evaluation (the engine's config, if
    # any, was applied before: deltaserve.engine.parallel.tensor_parallel.start_engine)
    cpu = on_cpu()
    compute_dtype = dtype or (mx.float32 if cpu else None)
    transform = None
    if parallel is not None:
        full = TextConfig.from_dict(_raw_config(path_or_id))
        shard_config(full, parallel.size)  # uneven shapes fail before any tensor is read
        transform = shard_weights(full, parallel.rank, parallel.size)
    ckpt = load_checkpoint(path_or_id, compute_dtype, not cpu, transform)
    cfg = TextConfig.from_dict(ckpt.config)
    if parallel is not None:
        cfg = shard_config(cfg, parallel.size)
    model = Qwen35Model(cfg, parallel)
    if ckpt.quantization:
        _quantize_experts(model, ckpt)
        _quantize_like(model, ckpt.quantization)
    model.load_weights(list(ckpt.weights.items()), strict=True)
    mx.eval(model.parameters())
    model.fuse_projections()
    model_dtype = ckpt.weights["embed_tokens.weight"].dtype
    if model_dtype not in (mx.float32, mx.float16, mx.bfloat16):
        model_dtype = compute_dtype or mx.bfloat16
    raw_config = json.loads((ckpt.path / "config.json").read_text())
    vision = load_vision(raw_config, ckpt.vision_weights, model_dtype)
    if vision is not None:
        ckpt.vision_weights = {}  # the tower holds them now (dequantized / reshaped copies)
    mtp = build_mtp_head(cfg, ckpt)
    if mtp is None:
        log_missing_head(ckpt.path)
    return LoadedModel(
        model, cfg, ckpt.path, model_dtype, bool(ckpt.quantization), ckpt,
        vision, vision.config if vision is not None else None, parallel, mtp,
    )  # fmt: skip


def build_mtp_head(cfg: TextConfig, ckpt: Checkpoint) -> MTPHead | None:
    """The MTP head from the checkpoint's mtp.* tensors (quantized ones stay quantized, as
    in the trunk); None when it has none. The tensors move into the head."""
    if not ckpt.mtp_weights:
        return None
    head = MTPHead(cfg)
    quantization = {
        name.removeprefix("mtp."): spec
        for name, spec in (ckpt.quantization or {}).items()
        if name.startswith("mtp.")
    }
    if quantization:
        _quantize_experts_of(head.layers, ckpt.mtp_weights, quantization)
        _quantize_like(head, quantization)
    head.load_weights(list(ckpt.mtp_weights.items()), strict=True)
    mx.eval(head.parameters())
    head.fuse_projections()
    ckpt.mtp_weights = {}
    return head


def _raw_config(path_or_id: str) -> dict:
    return json.loads((resolve_checkpoint(path_or_id) / "config.json").read_text())


def _quantize_experts(model: Qwen35Model, ckpt: Checkpoint) -> None:
    """Give each MoE layer whose stacked experts the checkpoint quantized the packed form
    (QuantizedSwitchExperts, gather_qmm): they stay as small as in the checkpoint."""
    quantization = ckpt.quantization or {}
    handled = _quantize_experts_of(model.layers, ckpt.weights, quantization)
    stray = [n for n in quantization if ".experts." in n and not n.startswith("mtp.")]
    stray = [n for n in stray if n.removesuffix(".weight") not in handled]
    if stray:
        raise CheckpointError(f"quantized expert tensors outside any MoE layer: {stray}")


def _quantize_experts_of(
    layers: list[DecoderLayer], weights: dict[str, mx.array], quantization: dict
) -> set[str]:
    """`_quantize_experts` for `layers` (named layers.{i}) over `weights`; returns the
    expert tensor names it took.

    The loader names a stacked packed weight X with X.scales / X.biases beside it; in the
    module tree X is then a submodule, so its packed weight is renamed X.weight (and its
    quantization entry with it: scales_name / biases_name still find the same tensors).
    """
    handled: set[str] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        names = {p: f"layers.{i}.mlp.experts.{p}" for p in EXPERT_PROJECTIONS}
        specs = {p: quantization.get(name) for p, name in names.items()}
        if all(spec is None for spec in specs.values()):
            continue
        _check_expert_specs(names, specs, weights)
        layer.mlp.quantize_experts(specs)
        for name in names.values():
            weights[f"{name}.weight"] = weights.pop(name)
            quantization[f"{name}.weight"] = quantization.pop(name)
            handled.add(name)
    return handled


def _check_expert_specs(names: dict[str, str], specs: dict, weights: dict) -> None:
    """Reject expert specs QuantizedSwitchExperts cannot hold, rather than dequantizing."""
    plain = [names[p] for p, spec in specs.items() if spec is None]
    if plain:
        raise CheckpointError(
            f"{plain} are not quantized but the other projections of those experts are; "
            "quantized experts need gate_proj, up_proj and down_proj all quantized"
        )
    for p, spec in specs.items():
        mode = spec.get("mode", "affine")
        has_biases = biases_name(names[p]) in weights
        if has_biases != (mode == "affine"):
            raise CheckpointError(
                f"{names[p]}: mode {mode!r} {'with' if has_biases else 'without'} biases; "
                "expected biases exactly for 'affine'"
            )


def _quantize_like(model: Qwen35Model, quantization: dict) -> None:
    """Swap Linear/Embedding layers for quantized ones where the checkpoint has scales."""

    def predicate(path: str, module: nn.Module) -> bool | dict:
        spec = quantization.get(f"{path}.weight")
        if spec is None or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": spec["group_size"], "bits": spec["bits"]}

    nn.quantize(model, class_predicate=predicate)
