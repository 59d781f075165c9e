"""What reading each weight once for the decode rows and a prompt chunk together would save.

    python -m bench.packed_matmuls --checkpoint 9B --rows 16 64 --sizes 16 64 256 512

A mixed step runs the decode rows' forward and the prompt chunk's forward as two graphs
(each compiled on a GPU), so every projection and MLP weight is read twice a step: once
for the rows' [B, H] activations and once for the chunk's [L, H]. At the 9B shape that
read is most of a decode step (17.5 GiB of bf16 weights). This times the model's linear
layers alone (each layer's fused projections, output projections, MLP and the LM head,
as loaded), synchronised around each measurement: every weight applied to the rows'
and the chunk's activations separately, against once to the two stacked ("packed"), and
to the rows alone (what a decode step's matmuls cost). The packed path's saving is the
most a mixed forward that shares its matmuls could take off a mixed step's fixed part.
Prints one JSON line per (rows, size) and a table; the ratio is separate / packed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn


def linears(model: nn.Module) -> list[nn.Module]:
    """Every linear layer of the text model (fused projections included; the LM head
    where it is not tied to the embedding)."""
    return [m for _, m in model.named_modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)]


def in_width(layer: nn.Module) -> int:
    """A linear layer's input width (a quantized one packs 32 // bits values a word)."""
    pack = 32 // layer.bits if isinstance(layer, nn.QuantizedLinear) else 1
    return layer.weight.shape[1] * pack


def _timed(fn, reps: int) -> float:
    """Median ms of fn()'s outputs evaluated, device synchronised around each."""
    times = []
    for i in range(reps + 2):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(layers: list[nn.Module], rows: int, size: int, dtype: mx.Dtype, reps: int) -> dict:
    """ms of the rows alone, rows and chunk separately, and the two packed."""
    inputs: dict[int, tuple[mx.array, mx.array, mx.array]] = {}
    for layer in layers:
        width = in_width(layer)
        if width not in inputs:
            a = mx.random.normal((rows, width)).astype(dtype)
            b = mx.random.normal((size, width)).astype(dtype)
            inputs[width] = (a, b, mx.concatenate([a, b]))
    mx.eval(*(x for trio in inputs.values() for x in trio))
    pairs = [(m, inputs[in_width(m)]) for m in layers]
    decode = _timed(lambda: [m(a) for m, (a, _, _) in pairs], reps)
    separate = _timed(lambda: [y for m, (a, b, _) in pairs for y in (m(a), m(b))], reps)
    packed = _timed(lambda: [m(ab) for m, (_, _, ab) in pairs], reps)
    return {
        "rows": rows,
        "chunk": size,
        "decode_ms": round(decode, 2),
        "separate_ms": round(separate, 2),
        "packed_ms": round(packed, 2),
        "saved_ms": round(separate - packed, 2),
        "ratio": round(separate / packed, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="small")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    from deltaserve.models.build import load_model
    from deltaserve.models.testing import cached_checkpoint

    loaded = load_model(cached_checkpoint(args.checkpoint))
    model = loaded.model
    layers = linears(model)
    dtype = model.embed_tokens.weight.dtype
    table = []
    for rows in args.rows:
        for size in args.sizes:
            line = measure(layers, rows, size, dtype, args.reps)
            line.update(checkpoint=args.checkpoint, linears=len(layers))
            print(json.dumps(line), flush=True)
            table.append(line)
    print("| rows | chunk | rows alone ms | separate ms | packed ms | saved ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['rows']} | {t['chunk']} | {t['decode_ms']} | {t['separate_ms']} | "
              f"{t['packed_ms']} | {t['saved_ms']} | {t['ratio']}x |")  # fmt: skip


if __name__ == "__main__":
    main()
