"""Checkpoint -> ready Qwen35Model on the current MLX device."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from models.config import TextConfig
from models.loader import Checkpoint, biases_name, load_checkpoint, scales_name
from models.qwen35 import Qwen35Model

log = logging.getLogger(__name__)


def on_cpu() -> bool:
    """True when MLX computes on the CPU (no Metal / CUDA device)."""
    return mx.default_device() == mx.cpu


@dataclass
class LoadedModel:
    """A built model plus what the engine and server need to know about it."""

    model: Qwen35Model = field(repr=False)
    config: TextConfig
    path: Path  # resolved local directory (tokenizer files live here)
    dtype: mx.Dtype  # activations / unquantized weights
    quantized: bool  # weights kept as MLX affine-quantized matmuls
    checkpoint: Checkpoint = field(repr=False)  # vision / MTP tensors stay here for later use

    def weight_bytes(self) -> int:
        return sum(v.nbytes for _, v in nn.utils.tree_flatten(self.model.parameters()))


def load_model(path_or_id: str, dtype: mx.Dtype | None = None) -> LoadedModel:
    """Load a Qwen3.5 checkpoint (local dir or hub id).

    On CPU: weights are upcast / dequantized to float32 (BLAS-backed f32 GEMM is an order
    of magnitude faster there than bf16 or quantized matmuls). On Metal/CUDA: checkpoint
    dtype and MLX quantized matmuls.
    """
    cpu = on_cpu()
    compute_dtype = dtype or (mx.float32 if cpu else None)
    ckpt = load_checkpoint(path_or_id, compute_dtype=compute_dtype, keep_quantized=not cpu)
    cfg = TextConfig.from_dict(ckpt.config)
    model = Qwen35Model(cfg)
    if ckpt.quantization:
        _dequantize_experts(ckpt, compute_dtype or mx.bfloat16)
        _quantize_like(model, ckpt.quantization)
    model.load_weights(list(ckpt.weights.items()), strict=True)
    mx.eval(model.parameters())
    model.fuse_projections()
    model_dtype = ckpt.weights["embed_tokens.weight"].dtype
    if model_dtype not in (mx.float32, mx.float16, mx.bfloat16):
        model_dtype = compute_dtype or mx.bfloat16
    return LoadedModel(model, cfg, ckpt.path, model_dtype, bool(ckpt.quantization), ckpt)


def _dequantize_experts(ckpt: Checkpoint, dtype: mx.Dtype) -> None:
    """Stacked MoE experts run through gather_mm, which has no quantized twin wired here
    yet (gather_qmm): dequantize them at load, loudly, so such checkpoints still load."""
    names = [n for n in ckpt.quantization if ".experts." in n and not n.startswith("mtp.")]
    for name in names:
        spec = ckpt.quantization.pop(name)
        scales = ckpt.weights.pop(scales_name(name))
        biases = ckpt.weights.pop(biases_name(name), None)
        ckpt.weights[name] = mx.dequantize(
            ckpt.weights[name], scales, biases, group_size=spec["group_size"], bits=spec["bits"]
        ).astype(dtype)
    if names:
        log.warning(
            "MoE experts dequantized to %s at load (%d tensors): quantized expert matmuls "
            "are not implemented yet, so they use more memory than the checkpoint",
            dtype,
            len(names),
        )


def _quantize_like(model: Qwen35Model, quantization: dict) -> None:
    """Swap Linear/Embedding layers for quantized ones where the checkpoint has scales."""

    def predicate(path: str, module: nn.Module) -> bool | dict:
        spec = quantization.get(f"{path}.weight")
        if spec is None or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": spec["group_size"], "bits": spec["bits"]}

    nn.quantize(model, class_predicate=predicate)
