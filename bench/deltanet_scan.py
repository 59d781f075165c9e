"""Benchmark: the CUDA DeltaNet prefill scan (kernels/gated_delta_scan.py) by tile size,
against the chunked WY form (kernels/gated_delta.py), one layer at Qwen3.5's head shapes.

Run on a CUDA machine (bench/gpu_session.sh `scan`):
    python3 -m bench.deltanet_scan
The scan stages TILE tokens' inputs in shared memory per round trip to global memory;
TILE=1 pays a round trip (and two block barriers) per token, as the kernel before tiles
paid one; a prefetched variant (`16p`) loads the next tile while it scans this one. Prints
a table: the fastest of --reps calls of each, each variant's speed-up over the first, and
the outputs' largest difference from the chunked form's (float32 state and y).
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from bench.gated_delta import make_inputs, time_ms
from deltaserve.kernels import gated_delta_scan as scan
from deltaserve.kernels.gated_delta import gated_delta_chunked
from deltaserve.kernels.platform import current_platform


def _run(variant: str, x: tuple) -> tuple[mx.array, mx.array]:
    """The scan at one variant: a tile size, `p` after it for the prefetched tiles."""
    # template constants read at launch: each variant is its own build
    tile = int(variant.rstrip("p"))
    scan._TILE, scan._TILE_WIDE, scan._PREFETCH = tile, tile, variant.endswith("p")
    return scan.gated_delta_scan(*x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--hv", type=int, nargs="+", default=[16, 32], help="value heads (0.8B, 9B)")
    ap.add_argument(
        "--tiles",
        nargs="+",
        default=["1", "16", "4p", "16p", "32p"],
        help="tile sizes; a trailing p: the next tile prefetched",
    )
    args = ap.parse_args()
    if current_platform().device != "cuda":
        raise SystemExit("the scan kernel runs on CUDA only (elsewhere it is the reference loop)")
    default = scan._TILE, scan._TILE_WIDE, scan._PREFETCH
    print("| B | L | Hv | chunked ms | " + " | ".join(f"tile {t} ms" for t in args.tiles)
          + " | " + " | ".join(f"tile {t} speed-up" for t in args.tiles[1:])
          + " | max diff vs chunked |")  # fmt: skip
    print("|" + "---|" * (4 + 2 * len(args.tiles)))
    for hv in args.hv:
        for b in args.rows:
            for length in args.lengths:
                x = make_inputs(b, length, 16, hv, 128)
                q, k, v, g, beta, state = x  # the model's dtypes: v bf16, the rest float32
                x = (q, k, v.astype(mx.bfloat16), g, beta, state)
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
    scan._TILE, scan._TILE_WIDE, scan._PREFETCH = default


if __name__ == "__main__":
    main()
