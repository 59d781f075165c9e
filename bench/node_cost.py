"""What one graph node costs MLX's host, by kind: views, elementwise launches, matmuls,
compiled (fused) kernels and custom kernels.

    python -m bench.node_cost --nodes 1000 --reps 5

On a GPU a step's time is mostly MLX evaluating its graph on the host (bench/README.md:
~5.6 us a node on an H100, averaged over a step's mix of kinds), so which kinds cost
what says which nodes are worth removing from a forward: a view (transpose, reshape,
slice, ...) launches nothing, a kernel node is also recorded into a CUDA graph. Each kind
is a chain of `--nodes` nodes of that kind on a small array (so the device's own work is
negligible: [64, 1024] bf16, a [1024, 1024] weight for the matmul), built, then
submitted with mx.async_eval and waited for; per kind the median over `--reps` of the
build, the submission (mx.async_eval) and the whole, in microseconds a node. Prints JSON
lines, then a markdown table with each kind's submission time against the elementwise
add's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

ROWS, WIDTH = 64, 1024


def _transpose(x: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = x.T
    return x


def _reshape(x: mx.array, n: int) -> mx.array:
    shapes = ((ROWS * 2, WIDTH // 2), (ROWS, WIDTH))
    for i in range(n):
        x = x.reshape(shapes[i % 2])
    return x


def _slice(x: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = x[:, ::-1]  # a strided view of the same size (a full-range slice is no node)
    return x


@functools.cache
def _operand(shape: tuple[int, int], value: float) -> mx.array:
    """An evaluated bf16 array (a chain's second operand: no nodes of its own)."""
    out = mx.full(shape, value, mx.bfloat16)
    mx.eval(out)
    return out


def _add(x: mx.array, n: int) -> mx.array:
    y = _operand((ROWS, WIDTH), 1.0)
    for _ in range(n):
        x = x + y
    return x


def _matmul(x: mx.array, n: int) -> mx.array:
    w = _operand((WIDTH, WIDTH), 1e-3)
    for _ in range(n):
        x = x @ w
    return x


@mx.compile
def _fused(x: mx.array) -> mx.array:
    """Eight elementwise ops: one kernel compiled."""
    return mx.sigmoid(x * 0.5 + 1.0) * mx.exp(-x * x) - x / 3.0


def _compiled(x: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = _fused(x)
    return x


def _custom_kernel() -> Callable[[mx.array], mx.array] | None:
    """A custom kernel that copies its input (one launch), where the device has them."""
    if mx.cuda.is_available():
        make = mx.fast.cuda_kernel
        source = "size_t i = blockIdx.x * blockDim.x + threadIdx.x; out[i] = inp[i];"
    elif mx.metal.is_available():
        make = mx.fast.metal_kernel
        source = "uint i = thread_position_in_grid.x; out[i] = inp[i];"
    else:
        return None
    kernel = make(name="node_cost_copy", input_names=["inp"], output_names=["out"], source=source)

    def run(x: mx.array) -> mx.array:
        return kernel(
            inputs=[x],
            grid=(x.size, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
        )[0]

    return run


def chains() -> dict[str, Callable[[mx.array, int], mx.array]]:
    """Each measured kind: a function building a chain of n nodes of it from x."""
    kinds = {
        "transpose (view)": _transpose,
        "reshape (view)": _reshape,
        "slice (view)": _slice,
        "add (elementwise)": _add,
        "matmul [64, 1024] x [1024, 1024]": _matmul,
        "compiled (8 ops fused)": _compiled,
    }
    custom = _custom_kernel()
    if custom is not None:

        def _custom(x: mx.array, n: int) -> mx.array:
            for _ in range(n):
                x = custom(x)
            return x

        kinds["custom kernel"] = _custom
    return kinds


def measure(build: Callable[[mx.array, int], mx.array], nodes: int, reps: int) -> dict:
    """Median microseconds a node to build, to submit (mx.async_eval) and in all."""
    x = mx.random.normal((ROWS, WIDTH)).astype(mx.bfloat16)
    mx.eval(x)
    mx.eval(build(x, nodes))  # first use: kernels built, compiled functions traced
    parts: dict[str, list[float]] = {"build": [], "submit": [], "total": []}
    for _ in range(reps):
        start = time.perf_counter()
        out = build(x, nodes)
        built = time.perf_counter()
        mx.async_eval(out)
        submitted = time.perf_counter()
        mx.synchronize()
        done = time.perf_counter()
        parts["build"].append(built - start)
        parts["submit"].append(submitted - built)
        parts["total"].append(done - start)
    return {f"{k}_us": round(1e6 * statistics.median(v) / nodes, 3) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000, help="nodes in each chain")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(json.dumps({"device": str(mx.default_device()), "nodes": args.nodes}), flush=True)
    rows = []
    for kind, build in chains().items():
        row = {"kind": kind, **measure(build, args.nodes, args.reps)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    add = next(r["submit_us"] for r in rows if r["kind"].startswith("add"))
    print("\n| kind | build us/node | submit us/node | total us/node | submit vs add |")
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = r["submit_us"] / add if add else float("nan")
        print(
            f"| {r['kind']} | {r['build_us']:.2f} | {r['submit_us']:.2f} | {r['total_us']:.2f}"
            f" | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
