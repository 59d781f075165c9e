"""Benchmark: Gated-DeltaNet per-step reference loop vs the chunked WY form (one layer).

Run:  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
      .venv/bin/python bench/gated_delta.py
Prints one JSON line per shape: ms per call for each path and the speedup (ref / chunked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deltaserve.kernels.gated_delta import (  # noqa: E402
    gated_delta_chunked,
    gated_delta_reference,
    gated_delta_step,
)


def make_inputs(b: int, length: int, hk: int, hv: int, d: int, seed: int = 0) -> tuple:
    """Realistic inputs: unit q/k (q scaled by d**-0.5), g in [-5, 0), beta in (0, 1)."""
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((b, length, hk, d), key=keys[0])
    k = mx.random.normal((b, length, hk, d), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * d**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((b, length, hv, d), key=keys[2])
    g = -mx.logaddexp(mx.random.normal((b, length, hv), key=keys[3]), 0.0)
    beta = mx.sigmoid(mx.random.normal((b, length, hv), key=keys[4]))
    state = 0.1 * mx.random.normal((b, hv, d, d), key=keys[5])
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_ms(fn: Callable[[], tuple], reps: int, clock: str = "wall") -> tuple[float, float]:
    """(median, min) ms of `reps` evaluated calls after one warm-up call.

    The min is reported too because a shared 2-core box is noisy; it is the better
    estimate of the uncontended cost. clock="cpu" sums process CPU time over threads:
    with OPENBLAS_NUM_THREADS=1 that is the single-core cost, robust to other load.
    """
    now = CLOCKS[clock]
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = now()
        mx.eval(fn())
        times.append((now() - t0) * 1e3)
    return sorted(times)[len(times) // 2], min(times)


def main() -> None:
    """Prints JSON lines for prefill (L = 128, 512) and one decode step."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--hv", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args()
    hk, d, cs, clk = 16, 128, args.chunk_size, args.clock
    for hv in args.hv:
        for length in args.lengths:
            x = make_inputs(1, length, hk, hv, d)
            ref = time_ms(lambda x=x: gated_delta_reference(*x), max(1, args.reps // 2), clk)
            chk = time_ms(lambda x=x: gated_delta_chunked(*x, chunk_size=cs), args.reps, clk)
            y0, s0 = gated_delta_reference(*x)
            y1, s1 = gated_delta_chunked(*x, chunk_size=cs)
            err = max(mx.abs(y0 - y1).max().item(), mx.abs(s0 - s1).max().item())
            row = {"B": 1, "L": length, "Hk": hk, "Hv": hv, "Dk": d, "Dv": d, "chunk": cs}
            row |= {"clock": clk}
            row |= {"ref_ms": round(ref[0], 2), "chunked_ms": round(chk[0], 2)}
            row |= {"ref_min_ms": round(ref[1], 2), "chunked_min_ms": round(chk[1], 2)}
            row |= {"speedup": round(ref[0] / chk[0], 1), "speedup_min": round(ref[1] / chk[1], 1)}
            row |= {"max_abs_err": err}
            print(json.dumps(row), flush=True)
        x = make_inputs(1, 1, hk, hv, d)
        step = time_ms(lambda x=x: gated_delta_step(*x), args.reps * 10, clk)
        ref = time_ms(lambda x=x: gated_delta_reference(*x), args.reps * 10, clk)
        row = {"B": 1, "L": 1, "Hk": hk, "Hv": hv, "Dk": d, "Dv": d, "clock": clk}
        row |= {"ref_ms": round(ref[0], 3), "step_ms": round(step[0], 3)}
        print(json.dumps(row | {"step_min_ms": round(step[1], 3)}), flush=True)


if __name__ == "__main__":
    main()
