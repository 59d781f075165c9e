"""Benchmark: one Gated-DeltaNet decode step (one layer) on the default device.

Run:  python -m bench.gated_delta_step [--batch 1 8 64] [--reps 50]
Paths: "ops" = the reference's plain MLX ops (one step, eager), "compiled" =
deltaserve.kernels.gated_delta.gated_delta_step (the compiled ops path decode uses today), "fast" =
mx.fast.gated_delta_update (inputs prepared outside the timed region), "fused" =
gated_delta_step_fused (the CUDA/Metal kernel; on CPU it is the compiled path again).

Two timings per path, medians, after warm-up:
  ms       one call per eval, wall clock around build + eval + mx.synchronize (what an
           eager decode step pays per layer, launch overhead included);
  chain_ms CHAIN calls carrying the state, graph built first, only eval + synchronize
           timed, divided by CHAIN (closer to GPU time per call).
bw_pct = state bytes read + written / (chain_ms * 4.3 TB/s, the H200's measured HBM copy
rate). err_* = max abs difference of fused vs the reference (y, state).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import mlx.core as mx

from deltaserve.kernels.gated_delta import gated_delta_reference, gated_delta_step
from deltaserve.kernels.gated_delta_fused import gated_delta_step_fused

HBM_BYTES_PER_S = 4.3e12
CHAIN = 50

Inputs = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]
Step = Callable[[mx.array], tuple[mx.array, mx.array]]  # state -> (y, new state)


def make_inputs(b: int, hk: int, hv: int, d: int, dtype: mx.Dtype) -> Inputs:
    """Decode inputs as the model passes them: q, k, g, beta float32; v in the model dtype."""
    keys = mx.random.split(mx.random.key(0), 6)
    q = mx.random.normal((b, 1, hk, d), key=keys[0])
    k = mx.random.normal((b, 1, hk, d), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * d**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((b, 1, hv, d), key=keys[2]).astype(dtype)
    g = -mx.logaddexp(mx.random.normal((b, 1, hv), key=keys[3]), 0.0)
    beta = mx.sigmoid(mx.random.normal((b, 1, hv), key=keys[4]))
    state = 0.1 * mx.random.normal((b, hv, d, d), key=keys[5])
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def steps(x: Inputs) -> dict[str, Step]:
    """Each path as a function of the incoming state."""
    q, k, v, g, beta, _ = x
    paths: dict[str, Step] = {
        "ops": lambda s: gated_delta_reference(q, k, v, g, beta, s),
        "compiled": lambda s: gated_delta_step(q, k, v, g, beta, s),
        "fused": lambda s: gated_delta_step_fused(q, k, v, g, beta, s),
    }
    if hasattr(mx.fast, "gated_delta_update"):
        f32 = [t.astype(mx.float32) for t in (q, k, v, beta)]
        gamma = mx.exp(g)
        mx.eval(f32, gamma)
        fq, fk, fv, fb = f32
        paths["fast"] = lambda s: mx.fast.gated_delta_update(fq, fk, fv, gamma, fb, s)
    return paths


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def time_call(step: Step, state: mx.array, reps: int) -> float:
    """Median ms of one build + eval + synchronize."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(step(state))
        mx.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def time_chain(step: Step, state: mx.array, reps: int) -> float:
    """Median ms per call of CHAIN dependent calls, graph built before the clock starts."""
    times = []
    for _ in range(max(1, reps // 5)):
        s, ys = state, []
        for _ in range(CHAIN):
            y, s = step(s)
            ys.append(y)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(s, ys)
        mx.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / CHAIN)
    return median(times)


def run_config(b: int, hk: int, hv: int, d: int, dtype: mx.Dtype, reps: int) -> dict:
    x = make_inputs(b, hk, hv, d, dtype)
    state = x[5]
    state_bytes = 2 * state.size * 4
    row: dict = {"B": b, "Hk": hk, "Hv": hv, "D": d, "v_dtype": str(dtype).split(".")[-1]}
    for name, step in steps(x).items():
        for _ in range(3):
            mx.eval(step(state))  # warm-up: JIT compile, allocator
        chain = time_chain(step, state, reps)
        row[name] = {
            "ms": round(time_call(step, state, reps), 4),
            "chain_ms": round(chain, 4),
            "bw_pct": round(100 * state_bytes / (chain * 1e-3 * HBM_BYTES_PER_S), 2),
        }
    y0, s0 = gated_delta_reference(*x)
    y1, s1 = gated_delta_step_fused(*x)
    diff = (mx.abs(y0.astype(mx.float32) - y1.astype(mx.float32)).max(), mx.abs(s0 - s1).max())
    row["err_y"], row["err_state"] = (float(f"{e.item():.3g}") for e in diff)
    return row


def main() -> None:
    """Prints one JSON line per (B, Hv) config; small batches by default on CPU."""
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64] if on_gpu else [1, 8])
    ap.add_argument("--hv", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--hk", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=50 if on_gpu else 5)
    args = ap.parse_args()
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__}))
    for hv in args.hv:
        for b in args.batch:
            dtype = getattr(mx, args.dtype)
            print(json.dumps(run_config(b, args.hk, hv, args.dim, dtype, args.reps)), flush=True)


if __name__ == "__main__":
    main()
