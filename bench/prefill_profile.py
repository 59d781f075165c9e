"""Where a prefill step's time goes: the DeltaNet core eager vs compiled, one cohort forward,
and the engine's step times (each step synchronised) at one batch size.

    python -m bench.prefill_profile --shape 0.8B --rows 16 --length 128 --batch 64

Prints JSON lines: per-call medians (ms) of the chunked recurrence and of one DeltaNet
core, a whole [rows, length] fresh-cohort forward with the compiled core off and on, and
per engine step (prefill tokens, decode rows, ms) for the first steps of a batch run.
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
    from models.deltanet import GatedDeltaNet

    for layer in model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if isinstance(mixer, GatedDeltaNet):
            mixer.compile_prefill = enabled


def kernel_lines(loaded, rows: int, length: int) -> list[dict]:
    """The chunked recurrence alone and one layer's core, eager vs compiled."""
    from functools import partial

    from kernels.gated_delta import gated_delta_chunked
    from models.deltanet import GatedDeltaNet, deltanet_core

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
    qkv, z, b_in, a_in = layer._project(x)
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


def forward_lines(loaded, rows: int, length: int) -> list[dict]:
    """One fresh [rows, length] cohort through the whole model (as the runner builds it)."""
    from engine.cache.batch import BatchState
    from models.state import ForwardGroup, text_positions

    tokens = mx.random.randint(100, 200000, (rows, length)).astype(mx.int32)
    positions = text_positions([0] * rows, length)

    def run() -> list[mx.array]:
        state = BatchState.empty(loaded.config)
        hidden = loaded.model([ForwardGroup(tokens, positions, state.layers)])[0]
        arrays = [a for layer in state.layers for a in layer.state_arrays()]
        return [loaded.model.logits(hidden[:, -1]), *arrays]

    out = []
    for enabled in (False, True):
        _set_compiled(loaded.model, enabled)
        out.append(
            {"what": "cohort_forward", "rows": rows, "length": length,
             "compiled_core": enabled, "ms": _median_ms(run, reps=5)}
        )  # fmt: skip
    _set_compiled(loaded.model, None)
    return out


def engine_step_lines(path: str, batch: int, prompt: int, gen: int, compiled: bool) -> dict:
    """Per-step (prefill tokens, decode rows, ms) of one batch run, each step synchronised."""
    from bench.engine_throughput import Ours, _prompts
    from engine.types import GenerationRequest, SamplingParams

    ours = Ours(path, 2048, 512, pack=False)
    _set_compiled(ours.loaded.model, compiled)
    steps: list[tuple[int, int, float]] = []
    for timed in (False, True):  # the first run warms up the traces of every shape
        engine = ours.make()
        execute = engine.runner.execute

        def wrapped(out, rows, prev, execute=execute, timed=timed):
            mx.synchronize()
            start = time.perf_counter()
            logits = execute(out, rows, prev)
            if logits is not None:
                mx.eval(logits)
            mx.synchronize()
            if timed:
                tokens = sum(c.length for c in out.prefill)
                steps.append((tokens, len(out.decode_row_ids), time.perf_counter() - start))
            return logits

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
        "prefill_steps": [(t, d, round(1e3 * s, 2)) for t, d, s in prefill],
        "decode_only_ms_p50": 1e3 * statistics.median(decode) if decode else None,
        "decode_steps": len(decode),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="0.8B", help="models.testing shape name or a path")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="engine run: prompts at once")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from models.build import load_model
    from models.testing import cached_checkpoint

    path = args.shape if "/" in args.shape else str(cached_checkpoint(args.shape))
    loaded = load_model(path)
    lines = [{"shape": args.shape, "device": str(mx.default_device())}]
    for line in kernel_lines(loaded, args.rows, args.length):
        lines.append(line)
        print(json.dumps(line), flush=True)
    for line in forward_lines(loaded, args.rows, args.length):
        lines.append(line)
        print(json.dumps(line), flush=True)
    del loaded
    for compiled in (False, True):
        line = engine_step_lines(path, args.batch, args.length, args.gen, compiled)
        lines.append(line)
        print(json.dumps(line), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
