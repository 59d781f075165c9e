"""Benchmark: the CUDA DeltaNet prefill scan (kernels/gated_delta_scan.py) against the
chunked WY form (kernels/gated_delta.py), one layer at Qwen3.5's head shapes and the
model's input dtypes (v bf16; q, k, g, beta float32).

Run on a CUDA machine (bench/gpu_session.sh `scan`):
    python3 -m bench.deltanet_scan
Prints a table: the fastest of --reps calls of each, the scan's speed-up over the chunked
form, and the largest difference between their outputs (y and the float32 state).
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from bench.gated_delta import make_inputs, time_ms
from deltaserve.kernels.gated_delta import gated_delta_chunked
from deltaserve.kernels.gated_delta_scan import gated_delta_scan
from deltaserve.kernels.platform import current_platform


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--hv", type=int, nargs="+", default=[16, 32], help="value heads (0.8B, 9B)")
    args = ap.parse_args()
    if current_platform().device != "cuda":
        raise SystemExit("the scan kernel runs on CUDA only (elsewhere it is the reference loop)")
    print("| B | L | Hv | chunked ms | scan ms | scan speed-up | max diff |")
    print("|---|---|---|---|---|---|---|")
    for hv in args.hv:
        for b in args.rows:
            for length in args.lengths:
                x = make_inputs(b, length, 16, hv, 128)
                q, k, v, g, beta, state = x  # the model's dtypes: v bf16, the rest float32
                x = (q, k, v.astype(mx.bfloat16), g, beta, state)
                chunked = time_ms(lambda x=x: gated_delta_chunked(*x), args.reps)[1]
                scan = time_ms(lambda x=x: gated_delta_scan(*x), args.reps)[1]
                pairs = zip(gated_delta_scan(*x), gated_delta_chunked(*x), strict=True)
                diff = max(
                    mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item()
                    for g, w in pairs
                )
                print(
                    f"| {b} | {length} | {hv} | {chunked:.3f} | {scan:.3f} | "
                    f"{chunked / scan:.2f}x | {diff:.2e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
