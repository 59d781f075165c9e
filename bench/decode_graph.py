"""What one engine decode step asks the device to run: its primitives, counted by kind.

    python -m bench.decode_graph --shape small --batch 4 --dtype bfloat16

On the GPU a decode step costs about its kernel count (each launch costs several us of
CPU time, more than the small kernels themselves: bench/README.md), so this counts the
nodes of the lazy graph of one steady-state step (the compiled decode, the gather of its
input tokens, sampling) as they would be dispatched. It runs on any device: which
primitives a graph holds and what mx.compile fuses do not depend on the backend. Views
(reshape, slice, broadcast, ...) usually launch nothing and are listed apart.
"""

from __future__ import annotations

import argparse
import io
import json
import re
from collections import Counter

import mlx.core as mx

# Primitives that are (usually) views or bookkeeping: no kernel of their own.
VIEWS = frozenset(
    {"Broadcast", "Reshape", "Slice", "Transpose", "AsStrided", "Squeeze", "ExpandDims",
     "StopGradient", "Split", "Depends", "Copy", "Unflatten", "Flatten"}
)  # fmt: skip


def step_graph(engine) -> list[mx.array]:
    """The arrays one engine step queues (mx.async_eval's arguments), not evaluated."""
    captured: list[mx.array] = []
    original = mx.async_eval

    def record(*arrays) -> None:
        captured.extend(a for a in arrays if isinstance(a, mx.array))

    mx.async_eval = record
    try:
        engine.step()
    finally:
        mx.async_eval = original
    return captured


def count_primitives(arrays: list[mx.array]) -> Counter:
    """Node labels of the graph of `arrays` (fused kernels as Compiled...)."""
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    labels = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', out.getvalue())
    return Counter("Compiled(fused)" if s.startswith("Compiled") else s for s in labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--shape", default="small", help="deltaserve.models.testing shape name or a path"
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-compile", action="store_true", help="the uncompiled decode step")
    args = ap.parse_args()
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import GenerationRequest, SamplingParams
    from deltaserve.models.build import load_model
    from deltaserve.models.testing import cached_checkpoint

    path = args.shape if "/" in args.shape else str(cached_checkpoint(args.shape))
    loaded = load_model(path, getattr(mx, args.dtype))
    config = EngineConfig(
        compile_decode=not args.no_compile, pipeline_steps=True, warm_up_seconds=0
    )
    engine = LLMEngine(loaded, config)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(args.batch):
        prompt = tuple(range(100 + i, 100 + i + args.prompt))
        engine.add_request(GenerationRequest(str(i), prompt, params))
    for _ in range(8):  # prefill, then a few decode steps (traces built)
        engine.step()
    arrays = step_graph(engine)
    counts = count_primitives(arrays)
    kernels = {k: v for k, v in counts.items() if k not in VIEWS}
    print(json.dumps({"shape": args.shape, "batch": args.batch, "dtype": args.dtype,
                      "layers": len(loaded.model.layers), "kernels": sum(kernels.values()),
                      "views": sum(counts.values()) - sum(kernels.values())}))  # fmt: skip
    for name, n in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {name}")


if __name__ == "__main__":
    main()
