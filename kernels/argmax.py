"""Row-wise argmax of [N, V] scores (a sampler's last reduction), one function per backend.

MLX's CPU argmax walks a row one element at a time (~1 ns each): the small shape's
[32, 248,320] float32 logits took 8-13 ms alone and 20-26 ms inside a decode step, right
behind the LM head that wrote them, against 1.1-1.5 ms for numpy's vectorised argmax over
the same buffer (CPU decode step at 32 rows: 75 -> 62 ms). So on the CPU, where the engine
reads a step's tokens back as soon as they exist (steps run in lockstep), the scores are
evaluated and reduced on the host. Where the caller needs the result inside the lazy graph
(a pipelined step gathers its next inputs from it) and on Metal/CUDA it is mx.argmax, which
is also the reference. Both return the first maximum of a row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from deltaserve.kernels.platform import current_platform

# Dtypes numpy reads from an MLX buffer as they are (numpy has no bfloat16).
_HOST_DTYPES = (mx.float32, mx.float16)


def argmax_rows(scores: mx.array, lazy: bool = True) -> mx.array:
    """Index of each row's first maximum: scores [N, V] -> [N] int32.

    lazy=False on the CPU: `scores` is evaluated now and reduced with numpy (the result is
    computed, not a graph node). lazy=True, or on another device: mx.argmax."""
    if lazy or not current_platform().is_cpu:
        return argmax_reference(scores)
    if scores.dtype not in _HOST_DTYPES:
        scores = scores.astype(mx.float32)  # exact: ties stay ties
    mx.eval(scores)
    return mx.array(np.asarray(scores).argmax(axis=-1).astype(np.int32))


def argmax_reference(scores: mx.array) -> mx.array:
    return mx.argmax(scores, axis=-1).astype(mx.int32)
