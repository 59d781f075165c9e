"""What a mixed step (decode rows + one prompt chunk) costs, and where its time goes.

    python -m bench.mixed_step --shape 0.8B --rows 8 64 --sizes 16 64 256 [--fresh] [--eager-chunks]
        [--graph] [--off fused_deltanet_chunk ...] [--packed]

Model level: a fresh [1, L] prompt group through the whole model and through one layer
of each kind, timed as graph building (the Python call until it returns lazy arrays)
and evaluation (device synchronised around each). Engine level: `--rows` rows decode
while a long prompt prefills; decode-only and mixed steps alternate (chunk sizes forced,
the stall bound off), each step synchronised; per chunk size the median mixed step, the
median decode-only step, and the CPU time inside runner.execute (graph building and
submission). With `--graph`, each kind of step also says what mx.async_eval itself took
(MLX encoding the graph for the device) and how many primitives its graph held, by kind
(mx.export_to_dot of the step's first measured instance): where the host time of a
step goes, per primitive. `--off` sets engine switches False (a kernel against its
reference in one call), `--on` True (the GPU's paths on the CPU). Prints JSON lines.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import statistics
import time
from collections import Counter, defaultdict

import mlx.core as mx


def _timed(fn, reps: int = 7, warmup: int = 2) -> dict:
    """Median build ms (fn() returning lazy arrays) and total ms (built + evaluated)."""
    builds, totals = [], []
    for i in range(warmup + reps):
        mx.synchronize()
        start = time.perf_counter()
        out = fn()
        built = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        if i >= warmup:
            builds.append(1e3 * (built - start))
            totals.append(1e3 * (time.perf_counter() - start))
    return {"build_ms": round(statistics.median(builds), 3),
            "total_ms": round(statistics.median(totals), 3)}  # fmt: skip


def _set_scan(model, enabled: bool | None) -> None:
    """Each DeltaNet layer's recurrence for prompts: the scan kernel, the chunked form, or
    (None) what the platform profile says (GatedDeltaNet.scan_prefill)."""
    for layer in model.layers:
        if not layer.is_full_attention:
            layer.linear_attn.scan_prefill = enabled


def model_lines(loaded, sizes: list[int]) -> list[dict]:
    """A fresh [1, L] group: whole model, one DeltaNet layer, one attention layer."""
    from deltaserve.engine.cache.batch import BatchState
    from deltaserve.models.state import ForwardGroup, text_positions

    model = loaded.model
    dn_idx = next(i for i, layer in enumerate(model.layers) if not layer.is_full_attention)
    at_idx = next(i for i, layer in enumerate(model.layers) if layer.is_full_attention)
    out = []
    for length in sizes:
        tokens = mx.random.randint(100, 200000, (1, length)).astype(mx.int32)
        positions = text_positions([0], length)

        def whole(tokens=tokens, positions=positions) -> list[mx.array]:
            state = BatchState.empty(loaded.config)
            group = ForwardGroup(tokens, positions, state.layers, outputs="last")
            hidden = model([group])
            arrays = [a for layer in state.layers for a in layer.state_arrays()]
            return [model.logits(hidden[0][:, -1]), *arrays]

        x = model.embed_tokens(tokens)
        mx.eval(x)

        def one(idx: int, x=x, tokens=tokens, positions=positions) -> list[mx.array]:
            from deltaserve.models.qwen35 import GroupContext

            state = BatchState.empty(loaded.config)
            group = ForwardGroup(tokens, positions, state.layers)
            layer = model.layers[idx]
            ctx = GroupContext.of(group, model._rope)
            h = layer.mix(x, group, ctx, state.layers[idx])
            h = layer.feed_forward(h)
            return [h, *state.layers[idx].state_arrays()]

        for scan in (False, True):  # the DeltaNet recurrence chunked, or as the scan kernel
            _set_scan(model, scan)
            for what, fn in (("whole_model", whole), ("deltanet_layer", lambda: one(dn_idx)),
                             ("attention_layer", lambda: one(at_idx))):  # fmt: skip
                line = {"what": what, "length": length, "scan": scan, **_timed(fn)}
                out.append(line)
                print(json.dumps(line), flush=True)
        _set_scan(model, None)
    return out


class _GraphProbe:
    """Wraps mx.async_eval: the seconds spent inside it during a step, and (once per step
    kind) the primitives of what it was given, counted by label from the DOT export."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count_next = False
        self.counts: Counter = Counter()
        self._async_eval = mx.async_eval

    def __call__(self, *arrays: mx.array) -> None:
        if self.count_next:
            dot = io.StringIO()
            mx.export_to_dot(dot, *arrays)
            self.counts += Counter(re.findall(r'label ="([^"]+)"', dot.getvalue()))
        start = time.perf_counter()
        self._async_eval(*arrays)
        self.seconds += time.perf_counter() - start

    def install(self) -> None:
        mx.async_eval = self

    def remove(self) -> None:
        mx.async_eval = self._async_eval


def engine_lines(
    path: str,
    rows: int,
    sizes: list[int],
    prompt: int,
    reps: int,
    fresh: bool = False,
    eager_chunks: bool = False,
    graph: bool = False,
    overrides: dict | None = None,
    packed: bool = False,
) -> list[dict]:
    """Alternate decode-only and mixed steps while a `prompt`-token prompt prefills, or
    with `fresh`, each mixed step's chunk a new `size`-token prompt (a chat arriving:
    its first and only chunk; it samples one token and leaves). The long prompt's later
    chunks run compiled where the device's default says so (a shape traced at its first
    use: the first pass meets them all), eagerly with `eager_chunks`. `packed`: mixed
    steps of decode rows and fresh prompts through engine/packed_step.py on any device
    (a GPU's engine runs it with pack_token_wise on)."""
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import GenerationRequest, SamplingParams
    from deltaserve.models.build import load_model

    loaded = load_model(path)
    config = EngineConfig(
        max_num_seqs=max(64, rows + 1), max_stall_factor=0, warm_up_seconds=0,
        compile_chunks=False if eager_chunks else None, **(overrides or {}),
    )  # fmt: skip
    engine = LLMEngine(loaded, config)
    if packed:  # as a GPU's engine with pack_token_wise builds it, on any device
        from deltaserve.engine.packed_step import PackedMixedStep

        engine.runner.packed = PackedMixedStep(loaded.model)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    for i in range(rows):
        ids = tuple(rng.randrange(1000, 50000) for _ in range(rng.randrange(32, 200)))
        engine.add_request(GenerationRequest(f"r{i}", ids, params))
    t0 = time.perf_counter()
    while len(engine.scheduler.state.decoding) < rows:
        start = time.perf_counter()
        engine.step()
        print(json.dumps({"warm_step_ms": round(1e3 * (time.perf_counter() - start), 1),
                          "decoding": len(engine.scheduler.state.decoding),
                          "t": round(time.perf_counter() - t0, 1)}), flush=True)  # fmt: skip
    for _ in range(8):
        engine.step()
    forced = {"tokens": 0}
    engine.scheduler.stall.allowance = lambda: forced["tokens"]
    execute = engine.runner.execute
    cpu = {"s": 0.0}

    def timed_execute(*a, **k):
        start = time.perf_counter()
        result = execute(*a, **k)
        cpu["s"] = time.perf_counter() - start
        return result

    engine.runner.execute = timed_execute
    walls: dict[int, list[float]] = defaultdict(list)
    builds: dict[int, list[float]] = defaultdict(list)
    submits: dict[int, list[float]] = defaultdict(list)
    probe, graphs = _GraphProbe(), {}
    if graph:
        probe.install()
    for rep in range(2):  # the first pass traces every shape; the second is measured
        # the runner traces no new prompt shape while rows stream (ModelRunner._may_trace):
        # a server's warm-up traces them at start, here the first pass does
        may_trace = type(engine.runner)._may_trace
        engine.runner._may_trace = (lambda plan: True) if rep == 0 else may_trace
        long_ids = tuple(rng.randrange(1000, 50000) for _ in range(prompt))
        if not fresh:
            engine.add_request(GenerationRequest(f"p{rep}", long_ids, params))
        cycle = [s for size in sizes for s in (0, size)]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for k in range(reps * len(cycle)):
            forced["tokens"] = cycle[k % len(cycle)]
            if fresh and forced["tokens"]:
                ids = tuple(rng.randrange(1000, 50000) for _ in range(forced["tokens"]))
                engine.add_request(GenerationRequest(f"f{rep}.{k}", ids, one))
            mx.synchronize()
            probe.seconds, probe.counts = 0.0, Counter()
            probe.count_next = graph and rep and forced["tokens"] not in graphs
            start = time.perf_counter()
            engine.step()
            mx.synchronize()
            if rep:
                walls[forced["tokens"]].append(1e3 * (time.perf_counter() - start))
                builds[forced["tokens"]].append(1e3 * cpu["s"])
                submits[forced["tokens"]].append(1e3 * probe.seconds)
                if probe.count_next:
                    graphs[forced["tokens"]] = probe.counts
        if not fresh:
            engine.abort(f"p{rep}")
        engine.step()
    decode = statistics.median(walls[0])
    out = []
    for size in [0, *sizes]:
        line = {
            "what": "engine_step", "rows": rows, "chunk": size, "fresh": fresh,
            "compiled_chunks": engine.runner.compile_chunks,
            "packed": engine.runner.packed is not None,
            "switches": dict(sorted((overrides or {}).items())),
            "wall_ms": round(statistics.median(walls[size]), 3),
            "execute_cpu_ms": round(statistics.median(builds[size]), 3),
            "x_decode": round(statistics.median(walls[size]) / decode, 2), "n": len(walls[size]),
        }  # fmt: skip
        if graph:
            counts = graphs.get(size, Counter())
            line["async_eval_ms"] = round(statistics.median(submits[size]), 3)
            line["primitives"] = sum(counts.values())
            line["by_kind"] = dict(counts.most_common(25))
        out.append(line)
        print(json.dumps(line), flush=True)
    probe.remove()
    if graph and 0 in graphs:
        for size in sizes:  # what a chunk adds to the decode rows' graph
            extra = graphs.get(size, Counter())
            extra.subtract(graphs[0])
            print(json.dumps({"what": "primitives_added", "chunk": size, "fresh": fresh,
                              "by_kind": dict(extra.most_common(30))}), flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--shape", default="0.8B", help="deltaserve.models.testing shape name or a path"
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument(
        "--fresh", action="store_true", help="each chunk a new prompt (a chat arriving)"
    )
    ap.add_argument("--eager-chunks", action="store_true", help="later chunks eagerly")
    ap.add_argument(
        "--graph", action="store_true", help="time mx.async_eval and count each step's primitives"
    )
    ap.add_argument(
        "--off", nargs="*", default=[], help="engine switches set False (e.g. fused_deltanet_chunk)"
    )
    ap.add_argument(
        "--on", nargs="*", default=[], help="engine switches set True (e.g. compile_decode)"
    )
    ap.add_argument(
        "--packed", action="store_true", help="the packed mixed step on any device (CPU too)"
    )
    args = ap.parse_args()
    from deltaserve.models.build import load_model
    from deltaserve.models.testing import cached_checkpoint

    path = args.shape if "/" in args.shape else str(cached_checkpoint(args.shape))
    print(json.dumps({"shape": args.shape, "device": str(mx.default_device())}), flush=True)
    if not args.skip_model:
        model_lines(load_model(path), args.sizes)
    for rows in args.rows:
        engine_lines(
            path, rows, args.sizes, args.prompt, args.reps, args.fresh, args.eager_chunks,
            args.graph, {name: False for name in args.off} | {name: True for name in args.on},
            args.packed,
        )  # fmt: skip


if __name__ == "__main__":
    main()
