"""Timing a device call in the micro-benchmarks: the median wall time of a function's
result evaluated on its own, the device synchronised around each call."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx


def median_eval_seconds(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median seconds of `mx.eval(fn())` over `reps` calls, after `warmup` calls (MLX
    builds a kernel the first time a shape needs it), each call between two
    mx.synchronize so that no earlier work is counted in it."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
