"""Where a prefill step's time goes: the DeltaNet core eager vs compiled, one cohort forward,
and the engine's step times (each step synchronised) at one batch size.

    python -m bench.prefill_profile --shape 0.8B --rows 16 --length 128 --batch 64

Prints JSON lines: per-call medians (ms) of the chunked recurrence and of one DeltaNet
core, whole-model forwards of fresh cohorts (one [rows, length] cohort, and five of
mixed shapes as a fragmented step has them) with the compiled prefill off and on, and
per engine step (prefill tokens, decode rows, ms) of a batch run plus where the time of
its steps goes (row-state ops, prefill forwards, the compiled decode).
Timings synchronise the device around each call (mx.synchronize), after warm-up calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx


def _median_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 2) -> float:
    """Median wall ms of fn() with its outputs evaluated, device synchronised around it."""
    times = []
    for i in range(warmup + reps):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _set_compiled(model, enabled: bool | None) -> None:
    from deltaserve.models.deltanet import GatedDeltaNet

    for layer in model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if isinstance(mixer, GatedDeltaNet):
            mixer.compile_prefill = enabled


def kernel_lines(loaded, rows: int, length: int) -> list[dict]:
    """The chunked recurrence alone and one layer's core, eager vs compiled."""
    from functools import partial

    from deltaserve.kernels.gated_delta import gated_delta_chunked
    from deltaserve.models.deltanet import GatedDeltaNet, deltanet_core

    layer = next(
        x.linear_attn for x in loaded.model.layers if isinstance(x.linear_attn, GatedDeltaNet)
    )
    hk, hv, d = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim
    keys = mx.random.split(mx.random.key(0), 8)
    q = mx.random.normal((rows, length, hk, d), key=keys[0])
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * d**-0.5
    k = mx.random.normal((rows, length, hk, d), key=keys[1])
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True))
    v = mx.random.normal((rows, length, hv, d), key=keys[2]).astype(loaded.dtype)
    g = -mx.logaddexp(mx.random.normal((rows, length, hv), key=keys[3]), 0.0)
    beta = mx.sigmoid(mx.random.normal((rows, length, hv), key=keys[4]))
    s0 = mx.zeros((rows, hv, d, d), mx.float32)
    chunked = partial(gated_delta_chunked, q, k, v, g, beta, s0)
    chunked_c = mx.compile(gated_delta_chunked)
    hidden = loaded.config.hidden_size
    x = mx.random.normal((rows, length, hidden), key=keys[5]).astype(loaded.dtype)
    qkv, z, b_in, a_in = layer.project(x)
    conv0 = mx.zeros((rows, layer.kernel_size - 1, layer.conv_dim), qkv.dtype)
    weights = (layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    args = (qkv, z, b_in, a_in, conv0, s0, *weights)
    core_c = mx.compile(partial(deltanet_core, layer._dims))
    mx.eval(q, k, v, g, beta, s0, *args)
    where = {"rows": rows, "length": length}
    return [
        {"what": "gated_delta_chunked", **where, "eager_ms": _median_ms(chunked),
         "compiled_ms": _median_ms(lambda: chunked_c(q, k, v, g, beta, s0))},
        {"what": "deltanet_core", **where,
         "eager_ms": _median_ms(lambda: deltanet_core(layer._dims, *args)),
         "compiled_ms": _median_ms(lambda: core_c(*args))},
    ]  # fmt: skip


def forward_lines(loaded, shapes: list[tuple[int, int]]) -> list[dict]:
    """Fresh cohorts of `shapes` [(rows, length), ...] through the whole model in one
    forward (as the runner builds a step), compiled prefill off and on."""
    from deltaserve.engine.cache.batch import BatchState
    from deltaserve.models.state import ForwardGroup, text_positions

    inputs = [
        (mx.random.randint(100, 200000, (r, n)).astype(mx.int32), text_positions([0] * r, n))
        for r, n in shapes
    ]

    def run() -> list[mx.array]:
        states = [BatchState.empty(loaded.config) for _ in shapes]
        groups = [ForwardGroup(t, p, s.layers) for (t, p), s in zip(inputs, states, strict=True)]
        hidden = loaded.model(groups)
        arrays = [a for s in states for layer in s.layers for a in layer.state_arrays()]
        return [loaded.model.logits(h[:, -1]) for h in hidden] + arrays

    out = []
    for enabled in (False, True):
        _set_compiled(loaded.model, enabled)
        out.append(
            {"what": "step_forward", "cohorts": shapes, "compiled_core": enabled,
             "ms": _median_ms(run, reps=5)}
        )  # fmt: skip
    _set_compiled(loaded.model, None)
    return out


def _timing(inner: Callable, phases: dict[str, float], phase: str) -> Callable:
    """inner, timed: its call and the evaluation of the arrays it returns (the device
    synchronised on both sides) add to phases[phase]."""

    def call(*args, **kw):
        mx.synchronize()
        start = time.perf_counter()
        result = inner(*args, **kw)
        arrays = result if isinstance(result, list) else [result]
        mx.eval([a for a in arrays if isinstance(a, mx.array)])
        mx.synchronize()
        phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start
        return result

    return call


class _TimedModel:
    """The model with its forward timed (logits and the rest pass through)."""

    def __init__(self, model, phases: dict[str, float]) -> None:
        self._model = model
        self._call = _timing(model, phases, "prefill_forward")

    def __call__(self, groups):
        return self._call(groups)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def engine_step_lines(path: str, batch: int, prompt: int, gen: int, compiled: bool) -> dict:
    """Per-step (prefill tokens, decode rows, ms) of one batch run, each step synchronised."""
    from bench.engine_throughput import Ours, _prompts
    from deltaserve.engine.types import GenerationRequest, SamplingParams

    ours = Ours(path, 2048, 512, pack=False)
    _set_compiled(ours.loaded.model, compiled)
    steps: list[tuple[int, int, float]] = []
    phases: dict[str, float] = {}
    for timed in (False, True):  # the first run warms up the traces of every shape
        engine = ours.make()
        if timed:  # where a step's time goes: row-state ops, forwards, the compiled decode
            runner = engine.runner
            runner.model = _TimedModel(runner.model, phases)
            runner._compiled_decode = _timing(runner._compiled_decode, phases, "decode")
            for name in ("sync", "cohort_state", "prefill_state", "split_cohort"):
                inner = getattr(runner.states, name)
                setattr(runner.states, name, _timing(inner, phases, "row_state_ops"))
        execute = engine.runner.execute

        def wrapped(out, execute=execute, timed=timed):
            mx.synchronize()
            start = time.perf_counter()
            output = execute(out)
            if output.logits is not None:
                mx.eval(output.logits)
            mx.synchronize()
            if timed:
                tokens = sum(c.length for c in out.prefill)
                steps.append((tokens, len(out.decode_row_ids), time.perf_counter() - start))
            return output

        engine.runner.execute = wrapped
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        for i, p in enumerate(_prompts(batch, prompt, prompt, seed=batch)):
            engine.add_request(GenerationRequest(str(i), tuple(p), params))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        wall = time.perf_counter() - start
    _set_compiled(ours.loaded.model, None)
    prefill = [(t, d, s) for t, d, s in steps if t]
    decode = [s for t, d, s in steps if not t and d]
    return {
        "what": "engine_steps", "batch": batch, "compiled_core": compiled, "wall_s": wall,
        "execute_s": sum(s for _, _, s in steps),
        "phases_s": {k: round(v, 4) for k, v in phases.items()},
        "prefill_steps": [(t, d, round(1e3 * s, 2)) for t, d, s in prefill],
        "decode_only_ms_p50": 1e3 * statistics.median(decode) if decode else None,
        "decode_steps": len(decode),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--shape", default="0.8B", help="deltaserve.models.testing shape name or a path"
    )
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="engine run: prompts at once")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument(
        "--engine", type=int, nargs="*", default=[0, 1], help="engine runs: compiled prefill 0/1"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from deltaserve.models.build import load_model
    from deltaserve.models.testing import cached_checkpoint

    path = args.shape if "/" in args.shape else str(cached_checkpoint(args.shape))
    loaded = load_model(path)
    lines = [{"shape": args.shape, "device": str(mx.default_device())}]
    for line in kernel_lines(loaded, args.rows, args.length):
        lines.append(line)
        print(json.dumps(line), flush=True)
    shapes = [[(args.rows, args.length)], [(19, 64), (8, 64), (2, 48), (1, 32), (1, 16)]]
    for cohorts in shapes:
        for line in forward_lines(loaded, cohorts):
            lines.append(line)
            print(json.dumps(line), flush=True)
    del loaded
    for compiled in args.engine:
        line = engine_step_lines(path, args.batch, args.length, args.gen, compiled)
        lines.append(line)
        print(json.dumps(line), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
