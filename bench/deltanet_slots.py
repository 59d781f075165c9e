"""What a speculative verify's DeltaNet layers cost against a decode step's: the decode
token kernel (`deltanet_decode`, one column) against its many-column form
(`deltanet_decode_slots`: a row's last token and its k drafts in turn, each column's
state kept for the rollback), per layer, at a shape's sizes.

    python3 -m bench.deltanet_slots --shape 9B --batch 1 16 --columns 1 2 3 4

Each timed call runs `--layers` layers' worth (each its own state, as the model's are)
and is evaluated alone, the device synchronised around it; the median over `--reps`,
divided by the layers. A column's work is the decode token's, so the slots form at L
columns should cost about L x the decode kernel where it is latency-bound (few rows) and
less where the state's bytes bound it (one read, L writes). On the CPU both are the plain
MLX references. Prints JSON lines and a table.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from bench.timing import median_eval_seconds
from deltaserve.kernels.deltanet_decode import DecodeDims, deltanet_decode, deltanet_decode_slots
from deltaserve.models.testing.config import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="9B", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--columns", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--layers", type=int, default=8, help="layers a timed call runs")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    s = SHAPES[args.shape]
    dims = DecodeDims(s.linear_k_heads, s.linear_head_dim, s.linear_v_heads,
                      s.linear_head_dim, 4, 1e-6)  # fmt: skip
    dtype = getattr(mx, args.dtype)
    print(json.dumps({"device": str(mx.default_device()), "shape": args.shape, "dims": str(dims)}))
    weights = (
        mx.random.normal((dims.conv_dim, dims.kernel)).astype(dtype) * 0.3,
        mx.random.normal((dims.num_v_heads,)).astype(mx.float32) * 0.1,
        mx.random.normal((dims.num_v_heads,)).astype(mx.float32) * 0.1,
        mx.ones((dims.head_v_dim,), dtype=mx.float32),
    )
    rows = []
    for batch in args.batch:
        states = [
            (
                mx.random.normal((batch, dims.kernel - 1, dims.conv_dim)).astype(dtype),
                mx.random.normal(
                    (batch, dims.num_v_heads, dims.head_v_dim, dims.head_k_dim)
                ).astype(mx.float32)
                * 0.1,
            )
            for _ in range(args.layers)
        ]
        mx.eval(states, weights)
        base = None
        for columns in args.columns:
            proj = mx.random.normal((batch, columns, dims.proj_dim)).astype(dtype)
            mx.eval(proj)
            if columns == 1:

                def call(proj=proj, states=states):
                    return [deltanet_decode(dims, proj[:, 0], c, h, *weights) for c, h in states]
            else:

                def call(proj=proj, states=states):
                    return [deltanet_decode_slots(dims, proj, c, h, *weights) for c, h in states]

            ms = 1e3 * median_eval_seconds(call, args.reps) / args.layers
            base = base or ms
            row = {"batch": batch, "columns": columns, "ms_a_layer": round(ms, 4),
                   "vs_decode": round(ms / base, 2)}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{args.shape} DeltaNet layer, {args.dtype}, {mx.default_device()}\n")
    print("| B | columns | ms a layer | vs one column (the decode kernel) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['columns']} | {r['ms_a_layer']:.4f} | {r['vs_decode']:.2f}x |")


if __name__ == "__main__":
    main()
