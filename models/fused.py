"""Projections that read the same input, fused into one matmul after loading.

A Qwen3.5 layer runs several small projections of one input: DeltaNet's qkv, z, b and a;
attention's q (+ gate), k and v; the MLP's gate and up. On the GPU a decode step costs
its kernel launches more than its FLOPs, so after the checkpoint is loaded under its HF
names the model concatenates each set along the output dimension (plain weights, or
affine-quantized weight/scales/biases when every part shares bits, group size and mode)
and splits the one result. The arithmetic of each output is unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class FusedLinear(nn.Module):
    """Bias-free Linear or QuantizedLinear layers over one input, as one layer.

    [..., H] -> list of [..., out_i] in the order the parts were given.
    """

    def __init__(self, proj: nn.Module, sizes: list[int]) -> None:
        super().__init__()
        self.proj = proj
        self._splits = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]

    def __call__(self, x: mx.array) -> list[mx.array]:
        return mx.split(self.proj(x), self._splits, axis=-1)


def fuse(parts: list[nn.Module]) -> FusedLinear | None:
    """One layer computing every part, or None when they cannot share a matmul (a bias,
    mixed quantization, or a layer kind this does not know)."""
    if any("bias" in p for p in parts):
        return None
    sizes = [int(p.weight.shape[0]) for p in parts]
    if all(type(p) is nn.Linear for p in parts):
        weights = [p.weight for p in parts]
        if len({w.dtype for w in weights}) != 1:
            return None
        proj = nn.Linear(int(weights[0].shape[1]), sum(sizes), bias=False)
        proj.weight = mx.concatenate(weights, axis=0)
        return FusedLinear(proj, sizes)
    if all(type(p) is nn.QuantizedLinear for p in parts):
        spec = {(p.group_size, p.bits, p.mode, "biases" in p) for p in parts}
        if len(spec) != 1:
            return None
        group_size, bits, mode, has_biases = spec.pop()
        proj = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(proj)
        proj.group_size, proj.bits, proj.mode = group_size, bits, mode
        proj.weight = mx.concatenate([p.weight for p in parts], axis=0)
        proj.scales = mx.concatenate([p.scales for p in parts], axis=0)
        if has_biases:
            proj.biases = mx.concatenate([p.biases for p in parts], axis=0)
        proj.freeze()
        return FusedLinear(proj, sizes)
    return None


def fuse_into(module: nn.Module, names: list[str], fused_name: str) -> bool:
    """Replace module.<names> by one FusedLinear at module.<fused_name> (freeing the
    parts); True when fused. The caller's forward reads the fused layer when present."""
    fused = fuse([module[name] for name in names])
    if fused is None:
        return False
    for name in names:
        module.pop(name)
    module[fused_name] = fused
    mx.eval(fused.parameters())
    return True
