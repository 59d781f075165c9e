"""What a projection costs with a few token rows against one: a speculative verify runs
each row's k + 1 positions (M = k + 1 = 2-4 per row at B = 1) through every weight that a
decode step runs one position through, so at B = 1 it should read the same weights in
about the same time. This prints, per dtype and weight shape, the time of `x @ w.T` for
M = 1, 2, 3, 4, 8 rows, its ratio to M = 1 and the bytes a second it reads, and the same
product written as `(w @ x.T).T` (another kernel choice for small M), so a verify step
that costs more than its decode step can be put down to the matmuls or not.

    python3 -m bench.small_m_matmul                        # 9B's shapes, float32 and bf16
    MLX_ENABLE_TF32=0 python3 -m bench.small_m_matmul      # float32 without TF32

(CUDA's float32 matmuls use TF32 unless MLX_ENABLE_TF32=0: bench.speculative's float32
runs turn it off, so compare them with that line.)
"""

from __future__ import annotations

import argparse
import json
import os

import mlx.core as mx

from bench.timing import median_eval_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=4096, help="9B: 4096")
    ap.add_argument("--inter", type=int, default=12288, help="9B's MLP width")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--stack", type=int, default=8, help="weights a timed call runs through")
    args = ap.parse_args()
    tf32 = os.environ.get("MLX_ENABLE_TF32", "unset")
    print(json.dumps({"device": str(mx.default_device()), "MLX_ENABLE_TF32": tf32}))
    shapes = {"up": (args.inter, args.hidden), "down": (args.hidden, args.inter)}
    table = []
    for dtype_name in args.dtypes:
        dtype = getattr(mx, dtype_name)
        for name, (n, k) in shapes.items():
            # a stack of weights, so one call reads more than the GPU's L2 holds
            ws = [mx.random.normal((n, k)).astype(dtype) * 0.02 for _ in range(args.stack)]
            mx.eval(ws)
            base = None
            for m in args.rows:
                x = mx.random.normal((m, k)).astype(dtype)
                mx.eval(x)
                plain = median_eval_seconds(lambda x=x, ws=ws: [x @ w.T for w in ws], args.reps)
                flipped = median_eval_seconds(
                    lambda x=x, ws=ws: [(w @ x.T).T for w in ws], args.reps
                )
                base = base or plain
                read = args.stack * n * k * x.itemsize
                row = {
                    "dtype": dtype_name,
                    "weight": f"{name} {n}x{k}",
                    "M": m,
                    "ms": round(1e3 * plain / args.stack, 4),
                    "vs_M1": round(plain / base, 2),
                    "GB_s": round(read / plain / 1e9, 1),
                    "flipped_ms": round(1e3 * flipped / args.stack, 4),
                }
                print(json.dumps(row), flush=True)
                table.append(row)
    print(f"\nMLX_ENABLE_TF32={tf32}\n")
    print("| dtype | weight | M | ms a matmul | vs M = 1 | GB/s | (w @ x.T).T ms |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['dtype']} | {r['weight']} | {r['M']} | {r['ms']:.4f} | {r['vs_M1']:.2f}x"
            f" | {r['GB_s']:.0f} | {r['flipped_ms']:.4f} |"
        )


if __name__ == "__main__":
    main()
