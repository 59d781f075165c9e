"""Benchmark: the CUDA DeltaNet prefill scan (kernels/gated_delta_scan.py) by tile size,
against the chunked WY form (kernels/gated_delta.py), one layer at Qwen3.5's head shapes.

Run on a CUDA machine (bench/gpu_session.sh `scan`):
    python3 -m bench.deltanet_scan
The scan stages TILE tokens' inputs in shared memory per round trip to global memory;
TILE=1 pays a round trip (and two block barriers) per token, as the kernel before tiles
paid one. Prints a table: the fastest of --reps calls of each, each tile size's speed-up
over the first (TILE=1),
and each output's largest difference from the chunked form's (float32 state and y).
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from bench.gated_delta import make_inputs, time_ms
from deltaserve.kernels import gated_delta_scan as scan
from deltaserve.kernels.gated_delta import gated_delta_chunked
from deltaserve.kernels.platform import current_platform


def _run(tile: int, x: tuple) -> tuple[mx.array, mx.array]:
    scan._TILE = tile  # a template constant read at launch: each tile size is its own build
    return scan.gated_delta_scan(*x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--hv", type=int, nargs="+", default=[16, 32], help="value heads (0.8B, 9B)")
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 4, 16, 32])
    args = ap.parse_args()
    if current_platform().device != "cuda":
        raise SystemExit("the scan kernel runs on CUDA only (elsewhere it is the reference loop)")
    default = scan._TILE
    print("| B | L | Hv | chunked ms | " + " | ".join(f"tile {t} ms" for t in args.tiles)
          + " | " + " | ".join(f"tile {t} speed-up" for t in args.tiles[1:])
          + " | max diff vs chunked |")  # fmt: skip
    print("|" + "---|" * (4 + 2 * len(args.tiles)))
    for hv in args.hv:
        for b in args.rows:
            for length in args.lengths:
                x = make_inputs(b, length, 16, hv, 128)
                x = tuple(a.astype(mx.bfloat16) for a in x[:5]) + (x[5],)
                chunked = time_ms(lambda x=x: gated_delta_chunked(*x), args.reps)[1]
                want = gated_delta_chunked(*x)
                times, diff = [], 0.0
                for tile in args.tiles:
                    times.append(time_ms(lambda t=tile, x=x: _run(t, x), args.reps)[1])
                    got = _run(tile, x)
                    for g, w in zip(got, want, strict=True):
                        d = mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item()
                        diff = max(diff, d)
                ratios = [times[0] / t for t in times[1:]]
                print(f"| {b} | {length} | {hv} | {chunked:.3f} | "
                      + " | ".join(f"{t:.3f}" for t in times) + " | "
                      + " | ".join(f"{r:.2f}x" for r in ratios) + f" | {diff:.2e} |",
                      flush=True)  # fmt: skip
    scan._TILE = default


if __name__ == "__main__":
    main()
