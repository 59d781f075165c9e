"""Random-weight Qwen3.5 checkpoints in the exact published Hugging Face layout.

Tensors are streamed into safetensors files one row-chunk at a time, so the published
shapes (up to 35B-A3B) can be written without holding them in memory. Every tensor has
its own RNG stream (seed, name), so fused and per-expert MoE layouts, sharded and single
files, all hold identical values. The mlx-community layout is produced by mlx-lm's own
converter from one of these HF checkpoints: an independent writer for loader tests.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaserve.models.testing.config import VOCAB_SIZE, Shape, hf_config, resolve_shape
from deltaserve.models.testing.tokenizer import write_tokenizer

PEAK_LOGIT_STD = 24.0  # logit std when peaked: mean top1-top2 gap ~ std / sqrt(2 ln V) ~ 4.8
ZERO_CENTRED_STD = 0.1  # zero-centred RMSNorm weights: gain = 1 + w with w ~ N(0, 0.1)
# With exact_gains, w is rounded to multiples of 2^-7, where 1 + w is exact in bf16, so
# mlx-lm's bf16 "+1" (reference section 1.3) equals transformers' float32 one and both
# references agree token for token. exact_gains=False exposes that precision hazard.
GAIN_STEP = 2.0**-7
CHUNK_ELEMENTS = 1 << 24  # generate at most 16M floats (64 MB) at a time
MAX_SHARD_BYTES = 5 << 30  # HF's default shard size when `shards` is not given
# Tied models score the input embedding itself, so a residual stream dominated by the
# current token's embedding makes the model echo its input; louder layers prevent that.
TIED_WRITER_GAIN = 2.5

# --------------------------------------------------------------------------- tensor plan

Chunks = Callable[[int], Iterator[np.ndarray]]  # seed -> float32 row blocks, C order


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, shape, safetensors dtype and value generator."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "BF16" or "F32"
    chunks: Chunks
    std: float = 0.0  # a projection's N(0, std) values (0: not a projection)
    zero_centred: bool = False  # a zero-centred RMSNorm weight (gain = 1 + w)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "BF16" else 4)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _normal(
    name: str, shape: tuple[int, ...], std: float, mean: float = 0.0, grid: float | None = None
) -> Chunks:
    def chunks(seed: int) -> Iterator[np.ndarray]:
        rng, row = _rng(seed, name), math.prod(shape[1:])
        step = max(1, CHUNK_ELEMENTS // max(row, 1))
        for start in range(0, shape[0], step):
            rows = min(step, shape[0] - start)
            block = rng.standard_normal((rows, *shape[1:]), dtype=np.float32) * std + mean
            yield np.round(block / grid) * grid if grid else block

    return chunks


def _uniform(name: str, size: int, low: float, high: float, log: bool = False) -> Chunks:
    def chunks(seed: int) -> Iterator[np.ndarray]:
        values = _rng(seed, name).uniform(low, high, size).astype(np.float32)
        yield np.log(values) if log else values

    return chunks


def _stacked(parts: list[Chunks]) -> Chunks:
    """Concatenate generators along dim 0, e.g. fused experts from per-expert streams."""
    return lambda seed: (block for part in parts for block in part(seed))


class _Plan:
    """Accumulates the TensorSpecs of one checkpoint.

    residual is the embedding std; projections writing into the residual stream get
    residual * writer_gain so every layer adds about as much as the embedding holds.
    """

    def __init__(self, residual: float, writer_gain: float, exact_gains: bool) -> None:
        self.specs: list[TensorSpec] = []
        self.residual = residual
        self.writer_std = residual * writer_gain
        self.gain_grid = GAIN_STEP if exact_gains else None

    def add(
        self, name: str, shape: tuple[int, ...], chunks: Chunks, dtype: str = "BF16", **kw
    ) -> None:
        self.specs.append(TensorSpec(name, shape, dtype, chunks, **kw))

    def reader(self, name: str, out: int, inp: int) -> None:
        """A projection fed by a normalised input: unit gain."""
        std = inp**-0.5
        self.add(name, (out, inp), _normal(name, (out, inp), std), std=std)

    def writer(self, name: str, out: int, inp: int) -> None:
        """A projection that writes into the residual stream (o_proj, out_proj, down_proj)."""
        std = self.writer_std * inp**-0.5
        self.add(name, (out, inp), _normal(name, (out, inp), std), std=std)

    def zero_centred_norm(self, name: str, size: int) -> None:
        chunks = _normal(name, (size,), ZERO_CENTRED_STD, grid=self.gain_grid)
        self.add(name, (size,), chunks, zero_centred=True)


def _attention(p: _Plan, pre: str, s: Shape) -> None:
    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    p.reader(f"{pre}.self_attn.q_proj.weight", 2 * q_out, s.hidden)  # query and gate per head
    p.reader(f"{pre}.self_attn.k_proj.weight", kv_out, s.hidden)
    p.reader(f"{pre}.self_attn.v_proj.weight", kv_out, s.hidden)
    p.writer(f"{pre}.self_attn.o_proj.weight", s.hidden, q_out)
    p.zero_centred_norm(f"{pre}.self_attn.q_norm.weight", s.head_dim)
    p.zero_centred_norm(f"{pre}.self_attn.k_norm.weight", s.head_dim)


def _linear_attention(p: _Plan, pre: str, s: Shape) -> None:
    key_dim = s.linear_k_heads * s.linear_head_dim
    value_dim, hv = s.linear_v_heads * s.linear_head_dim, s.linear_v_heads
    conv_dim, la = 2 * key_dim + value_dim, f"{pre}.linear_attn"
    p.reader(f"{la}.in_proj_qkv.weight", conv_dim, s.hidden)
    p.reader(f"{la}.in_proj_z.weight", value_dim, s.hidden)
    p.reader(f"{la}.in_proj_b.weight", hv, s.hidden)
    p.reader(f"{la}.in_proj_a.weight", hv, s.hidden)
    p.add(f"{la}.conv1d.weight", (conv_dim, 1, 4), _normal(f"{la}.conv1d", (conv_dim, 1, 4), 0.5))
    # Decay exp(-A * softplus(a + dt_bias)) spans near-1 (long memory) to fast per head.
    p.add(f"{la}.A_log", (hv,), _uniform(f"{la}.A_log", hv, 0.05, 4.0, log=True), "F32")
    p.add(f"{la}.dt_bias", (hv,), _uniform(f"{la}.dt_bias", hv, -3.0, 0.0), "F32")
    norm = f"{la}.norm.weight"  # plain gain around 1: RMSNormGated takes no +1
    p.add(norm, (s.linear_head_dim,), _normal(norm, (s.linear_head_dim,), 0.1, 1.0))
    p.writer(f"{la}.out_proj.weight", s.hidden, value_dim)


def _swiglu(p: _Plan, pre: str, hidden: int, inter: int) -> None:
    p.reader(f"{pre}.gate_proj.weight", inter, hidden)
    p.reader(f"{pre}.up_proj.weight", inter, hidden)
    p.writer(f"{pre}.down_proj.weight", hidden, inter)


def _moe(p: _Plan, pre: str, s: Shape, per_expert: bool) -> None:
    h, inter, n = s.hidden, s.moe_intermediate, s.experts
    p.reader(f"{pre}.mlp.gate.weight", n, h)
    names = [f"{pre}.mlp.experts.{e}" for e in range(n)]
    gate = [_normal(f"{x}.gate_proj.weight", (inter, h), h**-0.5) for x in names]
    up = [_normal(f"{x}.up_proj.weight", (inter, h), h**-0.5) for x in names]
    down = [_normal(f"{x}.down_proj.weight", (h, inter), p.writer_std * inter**-0.5) for x in names]
    up_std, down_std = h**-0.5, p.writer_std * inter**-0.5
    if per_expert:
        for x, g, u, d in zip(names, gate, up, down, strict=True):
            p.add(f"{x}.gate_proj.weight", (inter, h), g, std=up_std)
            p.add(f"{x}.up_proj.weight", (inter, h), u, std=up_std)
            p.add(f"{x}.down_proj.weight", (h, inter), d, std=down_std)
    else:  # published layout: gate rows then up rows per expert
        fused = [part for g, u in zip(gate, up, strict=True) for part in (g, u)]
        p.add(f"{pre}.mlp.experts.gate_up_proj", (n, 2 * inter, h), _stacked(fused), std=up_std)
        p.add(f"{pre}.mlp.experts.down_proj", (n, h, inter), _stacked(down), std=down_std)
    _swiglu(p, f"{pre}.mlp.shared_expert", h, s.shared_intermediate)
    p.reader(f"{pre}.mlp.shared_expert_gate.weight", 1, h)


def _layer(p: _Plan, pre: str, s: Shape, full: bool, per_expert: bool) -> None:
    p.zero_centred_norm(f"{pre}.input_layernorm.weight", s.hidden)
    (_attention if full else _linear_attention)(p, pre, s)
    p.zero_centred_norm(f"{pre}.post_attention_layernorm.weight", s.hidden)
    if s.experts:
        _moe(p, pre, s, per_expert)
    else:
        _swiglu(p, f"{pre}.mlp", s.hidden, s.intermediate)


def _vision(p: _Plan, s: Shape) -> None:
    depth, width, _, mlp, positions = s.vision
    merged, v = 4 * width, "model.visual"
    shapes = {"patch_embed.proj.weight": (width, 3, 2, 16, 16), "patch_embed.proj.bias": (width,)}
    shapes["pos_embed.weight"] = (positions, width)
    for j in range(depth):
        b = f"blocks.{j}"
        block = [("norm1", (width,)), ("norm2", (width,)), ("attn.qkv", (3 * width, width)),
                 ("attn.proj", (width, width)), ("mlp.linear_fc1", (mlp, width)),
                 ("mlp.linear_fc2", (width, mlp))]  # fmt: skip
        for key, shape in block:
            shapes[f"{b}.{key}.weight"], shapes[f"{b}.{key}.bias"] = shape, shape[:1]
    for key, shape in [("norm", (width,)), ("linear_fc1", (merged, merged)),
                       ("linear_fc2", (s.hidden, merged))]:  # fmt: skip
        shapes[f"merger.{key}.weight"], shapes[f"merger.{key}.bias"] = shape, shape[:1]
    for key, shape in shapes.items():
        name = f"{v}.{key}"
        if "norm" in key and key.endswith("weight"):  # LayerNorm gains around 1
            p.add(name, shape, _normal(name, shape, 0.1, 1.0))
        else:
            std = 0.02 if key.endswith("bias") else math.prod(shape[1:]) ** -0.5
            p.add(name, shape, _normal(name, shape, std))


def tensor_plan(
    s: Shape, peaked: bool = True, experts: str = "fused", exact_gains: bool = True
) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in writing order: text, then visual, then mtp."""
    if experts not in ("fused", "per_expert"):
        raise ValueError(f"experts must be 'fused' or 'per_expert', not {experts!r}")
    head_std = (PEAK_LOGIT_STD if peaked else 1.0) * s.hidden**-0.5
    # Tied: the head *is* the embedding, so scale it and every residual writer alike;
    # RMSNorm makes the network invariant to that, except the logits grow by the scale.
    p = _Plan(head_std, TIED_WRITER_GAIN, exact_gains) if s.tied else _Plan(1.0, 1.0, exact_gains)
    lm, per_expert = "model.language_model", experts == "per_expert"
    embed = f"{lm}.embed_tokens.weight"
    embed_chunks = _normal(embed, (VOCAB_SIZE, s.hidden), p.residual)
    p.add(embed, (VOCAB_SIZE, s.hidden), embed_chunks, std=p.residual)
    for i in range(s.layers):
        _layer(p, f"{lm}.layers.{i}", s, (i + 1) % 4 == 0, per_expert)
    p.zero_centred_norm(f"{lm}.norm.weight", s.hidden)
    if not s.tied:
        head = (VOCAB_SIZE, s.hidden)
        p.add("lm_head.weight", head, _normal("lm_head.weight", head, head_std), std=head_std)
    _vision(p, s)
    p.reader("mtp.fc.weight", s.hidden, 2 * s.hidden)  # [embedding; hidden] -> hidden
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        p.zero_centred_norm(f"mtp.{norm}.weight", s.hidden)
    _layer(p, "mtp.layers.0", s, full=True, per_expert=per_expert)
    return p.specs


# --------------------------------------------------------------------------- safetensors


def _to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (as torch does)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _write_safetensors(path: Path, specs: list[TensorSpec], seed: int) -> None:
    """Write one safetensors file, streaming every tensor chunk by chunk."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for spec in specs:
            written = 0
            for block in spec.chunks(seed):
                data = _to_bf16_bits(block) if spec.dtype == "BF16" else block.astype("<f4")
                f.write(data.tobytes())
                written += data.nbytes
            assert written == spec.nbytes, f"{spec.name}: wrote {written} of {spec.nbytes} bytes"


def _split_shards(specs: list[TensorSpec], shards: int | None) -> list[list[TensorSpec]]:
    """Consecutive groups: `shards` of about equal bytes, or by MAX_SHARD_BYTES."""
    total = sum(spec.nbytes for spec in specs)
    limit = math.ceil(total / shards) if shards else MAX_SHARD_BYTES
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + spec.nbytes > limit and (not shards or len(groups) < shards):
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return groups


def write_weights(out: Path, specs: list[TensorSpec], seed: int, shards: int | None) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    groups = _split_shards(specs, shards)
    if len(groups) == 1:
        _write_safetensors(out / "model.safetensors", groups[0], seed)
        return
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors(out / name, group, seed)
        weight_map.update({spec.name: name for spec in group})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------- entry points


def write_hf_checkpoint(
    out_dir: str | Path,
    shape: Shape,
    seed: int = 0,
    peaked: bool = True,
    experts: str = "fused",
    shards: int | None = None,
    exact_gains: bool = True,
) -> Path:
    """Write config.json, weights and tokenizer files of an HF-layout checkpoint."""
    out = _fresh_dir(out_dir)
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    write_weights(out, tensor_plan(shape, peaked, experts, exact_gains), seed, shards)
    write_tokenizer(out)
    return out


def convert_to_mlx(hf_dir: str | Path, out_dir: str | Path, bits: int | None) -> Path:
    """Run mlx-lm's converter (what `python -m mlx_lm convert -q --q-bits B` runs).

    bits None keeps bf16. mlx-lm drops the vision tower and MTP, shifts the zero-centred
    norms (+1 in bf16), stores conv1d as [C, K, 1], splits fused experts into
    `switch_mlp.*` and quantizes mlp.gate / shared_expert_gate at 8 bits (MoE).
    """
    from mlx_lm.convert import convert  # test dependency: imported only when used

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    if out.exists():
        out.rmdir()  # the converter insists on creating the directory itself
    convert(str(hf_dir), str(out), quantize=bits is not None, q_bits=bits, q_group_size=64)
    # The converter re-saves the tokenizer through transformers; keep the exact files
    # (and the generation config) that every checkpoint of ours carries.
    write_tokenizer(out)
    return out


def write_checkpoint(
    out_dir: str | Path,
    shape: str = "tiny",
    moe: bool = False,
    layout: str = "hf",
    bits: int | None = None,
    seed: int = 0,
    peaked: bool = True,
    experts: str = "fused",
    shards: int | None = None,
    exact_gains: bool = True,
) -> Path:
    """Write a random-weight Qwen3.5 checkpoint into the empty or missing dir `out_dir`.

    shape: a key of SHAPES ("tiny", "tiny-tied", "tiny-moe", "small", "0.8B", ... "35B-A3B");
    moe=True picks the MoE sibling of tiny/small. layout "hf" is the published bf16
    layout; "mlx" converts it with mlx-lm (bits 4 or 8 quantizes, None keeps bf16).
    peaked scales the output head so greedy decoding has wide top-1 margins. experts
    "per_expert" writes mlp.experts.{e}.*_proj.weight instead of the fused tensors.
    shards splits the weights into that many files plus an index. exact_gains rounds the
    zero-centred norm weights so that 1 + w is exact in bf16 (see GAIN_STEP). Returns out_dir.
    """
    spec = resolve_shape(shape, moe)
    if layout == "hf":
        if bits is not None:
            raise ValueError("bits applies to layout 'mlx' (the HF layout is bf16)")
        return write_hf_checkpoint(out_dir, spec, seed, peaked, experts, shards, exact_gains)
    if layout != "mlx":
        raise ValueError(f"layout must be 'hf' or 'mlx', not {layout!r}")
    if bits not in (None, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8 or None, not {bits!r}")
    _fresh_dir(out_dir)
    with tempfile.TemporaryDirectory(dir=Path(out_dir).parent) as tmp:
        hf = Path(tmp) / "hf"
        hf_dir = write_hf_checkpoint(hf, spec, seed, peaked, experts, shards, exact_gains)
        return convert_to_mlx(hf_dir, out_dir, bits)


def _fresh_dir(path: str | Path) -> Path:
    out = Path(path)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; refusing to overwrite a checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    return out
