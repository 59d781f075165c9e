"""How many kernels each kind of step launches: the graph's primitives, counted on the CPU.

    python -m bench.step_kernels --shape 0.8B --chunk 256 --rows 64

On the H200 a step costs about its kernel launches (bench/README.md: a compiled decode
step of 64 rows spent 7.1 of its 8.1 ms inside runner.execute), so the number of
primitives a step's graph holds is a figure the CPU can give for the GPU. The GPU-only
kernels (the DeltaNet prompt scan and decode token) are stubbed with one primitive each,
as they launch there; the rest of the graph is the model's own. View-like primitives
(reshape, slice, broadcast, transpose, ...) launch nothing and are counted apart. The
CPU builds mx.fast's ops from their parts (an RMSNorm is three primitives here and one
kernel on a GPU, an attention core several), so the counts overstate a GPU's launches,
most for the kinds with the most norms: compare kinds, not absolute figures.

Counts, for the model at `--shape` with random weights (nothing is written to disk;
`--narrow`: its layers at tiny widths, the same counts in seconds):
a later prompt chunk of `--chunk` tokens eagerly (compiled DeltaNet core, as on a GPU)
and through the compiled chunk forward (engine/decode.py), for one row and for two rows'
chunks in one call, a fresh prompt's first chunk
of that length compiled (engine/compiled_prefill.py), and the compiled decode step of
`--rows` rows, and the compiled speculative verify of `--drafts` + 1 columns a row.
Prints JSON lines.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import re
from dataclasses import replace

import mlx.core as mx
from mlx.utils import tree_map

VIEWS = {
    "AsStrided", "Broadcast", "Copy", "ExpandDims", "Flatten", "Reshape", "Slice",
    "Squeeze", "StopGradient", "Transpose", "Unflatten",
}  # fmt: skip


def count(arrays: list[mx.array], by_primitive: bool = False) -> dict:
    """Primitives of the unevaluated graph behind `arrays`: kernels and views, and with
    `by_primitive` each kernel primitive's count, most first."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    labels = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))
    views = sum(n for name, n in labels.items() if name in VIEWS)
    out = {"kernels": sum(labels.values()) - views, "views": views}
    if by_primitive:
        kernels = [(name, n) for name, n in labels.most_common() if name not in VIEWS]
        out["by_primitive"] = dict(kernels)
    return out


def _stub_gpu_kernels() -> None:
    """The DeltaNet scan and decode kernels (and the decode kernel's many-column form) as
    a few primitives each (the CPU runs their references, hundreds of ops; a GPU launches
    one kernel)."""
    import deltaserve.models.deltanet as deltanet

    def scan(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        g: mx.array,
        beta: mx.array,
        ssm: mx.array,
        mask: mx.array | None = None,
        scan: bool = False,
        every_state: bool = False,
    ) -> tuple[mx.array, mx.array]:
        return v * beta[..., None].astype(v.dtype), ssm * 1.0

    def decode(
        dims: deltanet.dn_decode.DecodeDims,
        proj: mx.array,
        conv: mx.array,
        ssm: mx.array,
        *weights: mx.array,
    ) -> tuple[mx.array, mx.array, mx.array]:
        return proj[:, : dims.num_v_heads * dims.head_v_dim] * 1.0, conv * 1.0, ssm * 1.0

    def slots(
        dims: deltanet.dn_decode.DecodeDims,
        proj: mx.array,
        conv: mx.array,
        ssm: mx.array,
        *weights: mx.array,
    ) -> tuple[mx.array, mx.array, mx.array]:
        b, columns = proj.shape[:2]
        y = proj[..., : dims.num_v_heads * dims.head_v_dim] * 1.0
        conv = mx.broadcast_to(conv[:, None], (b, columns, *conv.shape[1:])) * 1.0
        return y, conv, mx.broadcast_to(ssm[:, None], (b, columns, *ssm.shape[1:])) * 1.0

    deltanet.gated_delta = scan
    deltanet.dn_decode.deltanet_decode = decode
    deltanet.dn_decode.deltanet_decode_slots = slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="0.8B", help="deltaserve.models.testing shape name")
    ap.add_argument("--chunk", type=int, default=256, help="prompt chunk tokens")
    ap.add_argument("--rows", type=int, default=64, help="decode rows")
    ap.add_argument(
        "--narrow",
        action="store_true",
        help="the shape's layers at tiny widths: the same counts (they follow the layer "
        "count and kinds, not the widths) in seconds instead of minutes",
    )
    ap.add_argument("--drafts", type=int, default=2, help="a verify's drafts a row (k)")
    ap.add_argument("--by-primitive", action="store_true", help="each primitive's count too")
    args = ap.parse_args()
    _stub_gpu_kernels()
    from deltaserve.engine.cache.batch import BatchState
    from deltaserve.engine.compiled_prefill import CompiledPrefill
    from deltaserve.engine.decode import CompiledDecode
    from deltaserve.models.config import TextConfig
    from deltaserve.models.qwen35 import Qwen35Model
    from deltaserve.models.state import ForwardGroup, text_positions
    from deltaserve.models.testing.config import SHAPES, text_config

    shape = SHAPES[args.shape]
    if args.narrow:
        shape = replace(SHAPES["tiny"], layers=shape.layers, tied=shape.tied)
    cfg = TextConfig.from_dict(text_config(shape))
    model = Qwen35Model(cfg)
    model.update(tree_map(lambda p: p * 0.02, model.parameters()))
    model.fuse_projections()
    mx.eval(model.parameters())
    for layer in model.layers:
        if not layer.is_full_attention:  # as on a GPU
            layer.linear_attn.compile_prefill = True
            layer.linear_attn.fused_decode = True

    def arrays(state: BatchState) -> list[mx.array]:
        return [a for layer in state.layers for a in layer.state_arrays()]

    def started(length: int, rows: int = 1) -> BatchState:
        state = BatchState.empty(cfg)
        tokens = mx.zeros((rows, length), mx.int32)
        group = ForwardGroup(tokens, text_positions([0] * rows, length), state.layers)
        mx.eval(model([group]), arrays(state))
        return state

    def line(what: str, graph: list[mx.array]) -> None:
        shape = args.shape + (" (narrow)" if args.narrow else "")
        print(json.dumps({"what": what, "shape": shape, **count(graph, args.by_primitive)}),
              flush=True)  # fmt: skip
        mx.eval(graph)

    n, start = args.chunk, 64
    state = started(start)
    group = ForwardGroup(mx.zeros((1, n), mx.int32), text_positions([start], n), state.layers,
                         outputs="last")  # fmt: skip
    line(f"later chunk of {n}, eager", [model([group])[0], *arrays(state)])
    chunks = CompiledDecode(model)
    for run in range(2):  # the first call traces
        state = started(start)
        hidden = chunks.chunk([[0] * n], [start], state)
        if run:
            line(f"later chunk of {n}, compiled", [hidden, *arrays(state)])
        mx.eval(hidden, arrays(state))
    for run in range(2):  # two rows' chunks (n and 3n/4 tokens) in one call
        state = started(start)
        state.merge(started(start // 2))
        hidden = chunks.chunk([[0] * n, [0] * (3 * n // 4)], [start, start // 2], state)
        if run:
            line(f"later chunks of {n} and {3 * n // 4}, two rows, compiled",
                 [hidden, *arrays(state)])  # fmt: skip
        mx.eval(hidden, arrays(state))
    prompts = CompiledPrefill(model)
    for run in range(2):
        hidden, states = prompts([[0] * n], BatchState.empty(cfg))
        graph = [hidden, *(a for s in states for a in arrays(s))]
        if run:
            line(f"first chunk of {n}, compiled", graph)
        mx.eval(graph)
    decode = started(8, args.rows)
    steps = CompiledDecode(model)
    for run in range(2):
        logits = steps(mx.zeros((args.rows, 1), mx.int32), [8 + run] * args.rows, decode)
        if run:
            line(f"decode step of {args.rows} rows, compiled", [logits, *arrays(decode)])
        mx.eval(logits, arrays(decode))
    columns = args.drafts + 1
    verify, state = CompiledDecode(model), started(8, args.rows)
    for run in range(2):  # a speculative verify: k + 1 columns, every DeltaNet state kept
        offsets = [8 + run * columns] * args.rows
        hidden, logits = verify.verify(mx.zeros((args.rows, columns), mx.int32), offsets, state)
        slots = [a for layer in state.layers for a in (getattr(layer, "slots", None) or ())]
        graph = [logits, *arrays(state), *slots]
        if run:
            line(f"verify of {args.rows} rows x {columns} columns, compiled", graph)
        mx.eval(graph)


if __name__ == "__main__":
    main()
