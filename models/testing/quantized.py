"""Random-weight mlx-community quantized checkpoints written directly, never in bf16.

mlx-lm's converter needs the bf16 HF checkpoint first: 70 GB for 35B-A3B, more than the
GPU machine's disk. This writer produces the layout that converter produces (same tensor
names, shapes, dtypes and config.json; tests/test_checkpoint_quantized.py compares them on
the tiny shapes) straight from the tensor plan: projections get random codes with one
scale and bias per tensor, chosen so that the dequantized values have the plan's mean 0
and std; every other tensor (norms, conv, decay parameters) holds exactly the values the
converter would write for the same seed. Memory stays at one block of codes at a time.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaserve.models.testing.checkpoint import TensorSpec, _fresh_dir, _to_bf16_bits, tensor_plan
from deltaserve.models.testing.config import hf_config, resolve_shape
from deltaserve.models.testing.tokenizer import generation_config, write_tokenizer

GROUP_SIZE = 64
GATE_BITS = 8  # mlx-lm keeps the MoE router and shared-expert gate at 8 bits
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's shard size
BLOCK_WORDS = 1 << 24  # uint32 codes generated per block (64 MB)


@dataclass(frozen=True)
class _Tensor:
    """One stored tensor: safetensors dtype ("U32", "BF16", "F32") and its data blocks."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    blocks: object  # () -> Iterator[np.ndarray] of that dtype's storage type, C order

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "BF16" else 4)


def _mlx_name(hf_name: str) -> str | None:
    """HF parameter name -> mlx-lm's; None for what the converter drops (vision, MTP)."""
    if hf_name.startswith(("model.visual.", "mtp.")):
        return None
    if hf_name == "lm_head.weight":
        return "language_model.lm_head.weight"
    return "language_model." + hf_name.replace("model.language_model.", "model.", 1)


def _codes(name: str, seed: int, words: int) -> Iterator[np.ndarray]:
    # SFC64: the fastest of numpy's generators here (~0.6 GB/s; 19.5 GB for 35B-A3B)
    rng = np.random.Generator(np.random.SFC64([seed, zlib.crc32(name.encode()), 1]))
    for start in range(0, words, BLOCK_WORDS):
        yield rng.integers(0, 2**32, min(BLOCK_WORDS, words - start), dtype=np.uint32)


def _quantized(name: str, shape: tuple[int, ...], std: float, bits: int, seed: int) -> list:
    """(weight, scales, biases) of a projection [..., out, in]: uniform codes q in
    [0, 2^bits) have std sqrt((4^bits - 1) / 12); scale and bias make q*s + b ~ (0, std)."""
    levels = 2**bits
    scale = std / math.sqrt((levels * levels - 1) / 12)
    bias = -scale * (levels - 1) / 2
    *lead, out, inp = shape
    if inp % GROUP_SIZE:
        raise ValueError(f"{name}: input dim {inp} is not a multiple of {GROUP_SIZE}")
    module = name.removesuffix(".weight")
    packed = (*lead, out, inp * bits // 32)
    grouped = (*lead, out, inp // GROUP_SIZE)
    words = math.prod(packed)

    def constant(value: float) -> object:
        bits16 = _to_bf16_bits(np.array([value], np.float32))[0]
        return lambda: iter([np.full(math.prod(grouped), bits16, np.uint16)])

    return [
        _Tensor(name, packed, "U32", lambda: _codes(name, seed, words)),
        _Tensor(f"{module}.scales", grouped, "BF16", constant(scale)),
        _Tensor(f"{module}.biases", grouped, "BF16", constant(bias)),
    ]


def _plain(name: str, spec: TensorSpec, seed: int) -> _Tensor:
    """A tensor the converter keeps unquantized, with the converter's transformation."""
    values = np.concatenate([b.reshape(-1) for b in spec.chunks(seed)]).reshape(spec.shape)
    shape = spec.shape
    if name.endswith("conv1d.weight"):  # HF [C, 1, K] -> mlx [C, K, 1]
        values = np.moveaxis(values, 2, 1)
        shape = values.shape
    if name.endswith("A_log"):  # mlx-lm's cast predicate keeps A_log in float32
        return _Tensor(name, shape, "F32", lambda: iter([values.astype("<f4")]))
    bf16 = _to_bf16_bits(values)
    if spec.zero_centred:  # the converter adds 1 in bf16 (exact on the writer's gain grid)
        shifted = bf16.astype(np.uint32) << np.uint32(16)
        bf16 = _to_bf16_bits(shifted.view(np.float32) + np.float32(1.0))
    return _Tensor(name, shape, "BF16", lambda: iter([bf16]))


def _expert_parts(spec: TensorSpec) -> list[tuple[str, tuple[int, ...]]]:
    """HF fused experts -> mlx-lm's switch_mlp tensors (name suffix, shape)."""
    n, rows, cols = spec.shape
    if spec.name.endswith("gate_up_proj"):
        return [("switch_mlp.gate_proj.weight", (n, rows // 2, cols)),
                ("switch_mlp.up_proj.weight", (n, rows // 2, cols))]  # fmt: skip
    return [("switch_mlp.down_proj.weight", (n, rows, cols))]


def _tensors(specs: list[TensorSpec], bits: int, seed: int) -> tuple[list[_Tensor], dict]:
    """Every stored tensor, and the per-module bit overrides of the config."""
    out, overrides = [], {}
    for spec in specs:
        name = _mlx_name(spec.name)
        if name is None:
            continue
        if ".mlp.experts." in name:
            prefix = name.split(".experts.")[0]
            for suffix, shape in _expert_parts(spec):
                out += _quantized(f"{prefix}.{suffix}", shape, spec.std, bits, seed)
        elif spec.std and len(spec.shape) >= 2:
            module = name.removesuffix(".weight")
            gate = module.endswith(("mlp.gate", "shared_expert_gate"))
            if gate:
                overrides[module] = {"group_size": GROUP_SIZE, "bits": GATE_BITS}
            out += _quantized(name, spec.shape, spec.std, GATE_BITS if gate else bits, seed)
        else:
            out.append(_plain(name, spec, seed))
    return sorted(out, key=lambda t: t.name), overrides


def _write_file(path: Path, tensors: list[_Tensor]) -> None:
    header: dict[str, dict] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            written = sum(f.write(block.tobytes()) for block in t.blocks())
            assert written == t.nbytes, f"{t.name}: wrote {written} of {t.nbytes} bytes"


def _config(shape_name: str, bits: int, overrides: dict) -> dict:
    """The converter's config.json: HF's without the vision section, the generation
    config's EOS list, mlx-lm's rope key spelling, and the quantization sections."""
    cfg = hf_config(resolve_shape(shape_name, False))
    cfg.pop("vision_config")
    cfg["eos_token_id"] = generation_config()["eos_token_id"]
    rope = cfg["text_config"]["rope_parameters"]
    rope["type"] = rope.pop("rope_type")
    quant = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine", **overrides}
    cfg["quantization"], cfg["quantization_config"] = quant, dict(quant)
    return dict(sorted(cfg.items()))


def write_mlx_quantized(
    out_dir: str | Path, shape: str, bits: int = 4, seed: int = 0, peaked: bool = True
) -> Path:
    """Write a random mlx-community `bits`-bit checkpoint of `shape` into an empty dir."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits!r}")
    out = _fresh_dir(out_dir)
    tensors, overrides = _tensors(tensor_plan(resolve_shape(shape, False), peaked), bits, seed)
    shards: list[list[_Tensor]] = [[]]
    for t in tensors:
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + t.nbytes > MAX_SHARD_BYTES:
            shards.append([])
        shards[-1].append(t)
    weight_map = {}
    for i, group in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        if len(shards) == 1:
            name = "model.safetensors"
        _write_file(out / name, group)
        weight_map.update({t.name: name for t in group})
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    (out / "config.json").write_text(json.dumps(_config(shape, bits, overrides), indent=4))
    write_tokenizer(out)
    return out
