"""Where an MoE decode step's time goes, ours vs mlx-lm, on one checkpoint.

    python -m bench.moe_profile --shape 35B-A3B-mlx-4bit --batches 1 16 --out moe.jsonl

Prints JSON lines:
- "moe": layer 0's sparse MoE block alone on random tokens [B, H] (--moe-batches), per call
  (each call evaluated and the device synchronised) and per call of a 16-call chain
  (GPU-bound): ours with rows always / never sorted by expert
  (deltaserve.models.layers.SORT_MIN_ROWS 0 / 2^30), eager and compiled, and mlx-lm's block
  on the same weights; plus its parts (router, experts, shared expert).
- "decode": steady-state engine steps (ours, pipelined as in bench.gpu) and mlx-lm
  decode steps (model + cache, eager, argmax) at B rows after a prompt of --prompt tokens,
  ms per step (median); ours with SORT_MIN_ROWS at 0 (always sort) and 64 (mlx-lm's).
- "kernels": with --kernels, the GPU kernels of a few of those calls through
  torch.profiler (CUPTI sees MLX's kernels too): per call, the busy GPU time and the top
  kernels by time. Without torch, or when it fails, a line says so and the rest runs.

On a cold H200 (NVRTC compiling every new kernel) the "decode" section of the 35B-A3B shape
did not finish within 300 s; the "moe" section and its kernel tables take ~1 minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import mlx.core as mx

import deltaserve.models.layers as layers

NEVER = 1 << 30  # SORT_MIN_ROWS that never sorts
OUT: list[str] = []  # the --out file, appended to line by line (a killed run keeps them)


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)
    for path in OUT:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def per_call_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median wall ms of fn() with its outputs evaluated, the device synchronised around."""
    times = []
    for i in range(warmup + reps):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def chained_ms(fn: Callable[[mx.array], mx.array], x: mx.array, n: int = 16) -> float:
    """ms per call of n calls fed into each other in one evaluation (device-bound)."""

    def run() -> mx.array:
        y = x
        for _ in range(n):
            y = fn(y) * 0.5 + x
        return y

    return per_call_ms(run, reps=5, warmup=2) / n


def kernel_table(fn: Callable[[], None], calls: int, top: int = 18) -> dict:
    """GPU kernels of `calls` calls of fn (which evaluates its own work): per call, the
    busy time (sum of kernel times, us), the kernel count, and the top kernels."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:  # pragma: no cover - a machine without torch
        return {"error": f"no torch: {e}"}
    fn()
    mx.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            mx.synchronize()
    except Exception as e:  # noqa: BLE001 - report and go on
        return {"error": repr(e)[:300]}
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            entry = totals[event.name[:90]]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    if not totals:  # kernels no torch op launched: read Kineto's raw events
        for event in prof.profiler.kineto_results.events():
            if str(event.device_type()).endswith("CUDA"):
                entry = totals[event.name()[:90]]
                entry[0] += 1
                entry[1] += event.duration_ns() / 1e3
    busy = sum(v[1] for v in totals.values()) / calls
    count = sum(v[0] for v in totals.values()) / calls
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "busy_us_per_call": round(busy, 1),
        "kernels_per_call": round(count, 1),
        "top": [(name, round(n / calls, 2), round(us / calls, 1)) for name, (n, us) in ranked],
    }


# ------------------------------------------------------------------------------ the MoE block


def moe_lines(ours_model, mlx_model, batches: list[int], kernels: bool) -> None:
    ours = ours_model.layers[0].mlp
    theirs = mlx_model.language_model.model.layers[0].mlp
    hidden = ours_model.config.hidden_size
    for batch in batches:
        x = mx.random.normal((batch, hidden), key=mx.random.key(batch)) * 0.5
        x = x.astype(mx.bfloat16)
        probs = mx.softmax(ours.gate(x).astype(mx.float32), axis=-1)
        indices = mx.argpartition(-probs, kth=ours.top_k - 1, axis=-1)[:, : ours.top_k]
        indices = indices.astype(mx.uint32)
        mx.eval(x, indices)
        moe_batch(ours, theirs, x, indices, kernels)


def moe_batch(ours, theirs, x: mx.array, indices: mx.array, kernels: bool) -> None:
    """One batch size: ours (rows always sorted by expert / never), mlx-lm, parts."""
    batch, k = indices.shape
    where = {"what": "moe", "batch": batch, "rows": batch * k}
    default_sort = layers.SORT_MIN_ROWS
    for sort in (0, NEVER):
        layers.SORT_MIN_ROWS = sort
        compiled = mx.compile(lambda v: ours(v))
        emit({**where, "impl": f"ours sort_min_rows={sort}",
              "eager_ms": per_call_ms(lambda: ours(x)),
              "compiled_ms": per_call_ms(lambda c=compiled: c(x)),
              "chain_eager_ms": chained_ms(ours, x),
              "chain_compiled_ms": chained_ms(compiled, x),
              "experts_eager_ms": per_call_ms(lambda: ours.experts(x, indices)),
              "experts_chain_ms": chained_ms(
                  lambda v: ours.experts(v, indices).sum(1), x)})  # fmt: skip
    layers.SORT_MIN_ROWS = default_sort
    x3, idx3 = x[:, None, :], indices[:, None]
    compiled = mx.compile(lambda v: theirs(v))
    emit({**where, "impl": "mlx_lm",
          "eager_ms": per_call_ms(lambda: theirs(x3)),
          "compiled_ms": per_call_ms(lambda: compiled(x3)),
          "chain_eager_ms": chained_ms(theirs, x3),
          "chain_compiled_ms": chained_ms(compiled, x3),
          "experts_eager_ms": per_call_ms(lambda: theirs.switch_mlp(x3, idx3)),
          "experts_chain_ms": chained_ms(
              lambda v: theirs.switch_mlp(v, idx3).sum(-2), x3)})  # fmt: skip

    def router() -> list[mx.array]:
        p = mx.softmax(ours.gate(x).astype(mx.float32), axis=-1)
        i = mx.argpartition(-p, kth=k - 1, axis=-1)[:, :k]
        return [i, mx.take_along_axis(p, i, axis=-1)]

    emit({**where, "impl": "ours parts",
          "router_ms": per_call_ms(router),
          "shared_ms": per_call_ms(lambda: ours.shared_expert(x)),
          "shared_gate_ms": per_call_ms(lambda: ours.shared_expert_gate(x)),
          "argsort_ms": per_call_ms(lambda: mx.argsort(indices.reshape(-1)))})  # fmt: skip
    if kernels:
        for sort in (0, NEVER):
            layers.SORT_MIN_ROWS = sort
            emit({**where, "what": "kernels", "of": f"ours moe sort_min_rows={sort}",
                  **kernel_table(lambda: mx.eval(ours(x)), 10)})  # fmt: skip
        layers.SORT_MIN_ROWS = default_sort
        emit({**where, "what": "kernels", "of": "mlx_lm moe",
              **kernel_table(lambda: mx.eval(theirs(x3)), 10)})  # fmt: skip


# ------------------------------------------------------------------------------ decode steps


def ours_decode(path_loaded, batch: int, prompt: int, steps: int, kernels: bool, label: str):
    """Steady-state engine steps of `batch` rows (every row decoding)."""
    from bench.engine_throughput import _prompts
    from deltaserve.engine.types import GenerationRequest, SamplingParams

    ours = path_loaded
    engine = ours.make()
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 64, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt, prompt, seed=batch)):
        engine.add_request(GenerationRequest(str(i), tuple(p), params))
    seen: dict[str, int] = defaultdict(int)
    start = time.perf_counter()
    while len(seen) < batch or min(seen.values()) < 3:
        for d in engine.step():
            if d.token_ids:
                seen[d.request_id] += 1
    prefill_s = time.perf_counter() - start
    for _ in range(4):  # warm the trace of this batch's shapes
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t))
    line = {"what": "decode", "impl": label, "batch": batch, "prompt": prompt,
            "step_ms_p50": statistics.median(times), "step_ms_min": min(times),
            "until_all_decode_s": prefill_s}  # fmt: skip
    emit(line)
    if kernels:
        emit({"what": "kernels", "of": f"{label} decode step", "batch": batch,
              **kernel_table(engine.step, 6)})  # fmt: skip
    del engine
    gc.collect()


def mlx_decode(model, batch: int, prompt: int, steps: int, kernels: bool) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from bench.engine_throughput import _prompts

    tokens = mx.array(_prompts(batch, prompt, prompt, seed=batch), dtype=mx.int32)
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for s in range(0, prompt, 512):
        logits = model(tokens[:, s : s + 512], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    prefill_s = time.perf_counter() - start
    tok = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)

    def step() -> None:
        nonlocal tok
        out = model(tok, cache=cache)
        tok = mx.argmax(out[:, -1:], axis=-1).astype(mx.int32)
        mx.eval(tok)

    for _ in range(4):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - t))
    emit({"what": "decode", "impl": "mlx_lm", "batch": batch, "prompt": prompt,
          "step_ms_p50": statistics.median(times), "step_ms_min": min(times),
          "prefill_s": prefill_s})  # fmt: skip
    if kernels:
        emit({"what": "kernels", "of": "mlx_lm decode step", "batch": batch,
              **kernel_table(step, 6)})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="35B-A3B-mlx-4bit")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--moe-batches", type=int, nargs="+", default=[1, 16, 2048])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kernels", action="store_true", help="torch.profiler kernel tables")
    ap.add_argument("--skip", nargs="*", default=[], choices=["moe", "decode", "mlx_lm"])
    ap.add_argument(
        "--sort-min-rows",
        type=int,
        nargs="*",
        default=None,
        help="ours' decode runs at these SORT_MIN_ROWS (default: 0 and 64)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import mlx_lm

    from bench.engine_throughput import Ours
    from deltaserve.models.testing import cached_checkpoint

    if args.out:
        OUT.append(args.out)
    path = args.shape if "/" in args.shape else str(cached_checkpoint(args.shape))
    emit({"shape": args.shape, "device": str(mx.default_device())})
    ours = Ours(path, 2048, 512, pack=False)
    mlx_model = None if "mlx_lm" in args.skip else mlx_lm.load(path)[0]
    if "moe" not in args.skip and mlx_model is not None:
        moe_lines(ours.loaded.model, mlx_model, args.moe_batches, args.kernels)
    if "decode" not in args.skip:
        default_sort = layers.SORT_MIN_ROWS
        for batch in args.batches:
            if mlx_model is not None:
                mlx_decode(mlx_model, batch, args.prompt, args.steps, args.kernels)
            for sort in args.sort_min_rows or (0, 64):
                layers.SORT_MIN_ROWS = sort  # each engine traces its own decode step
                label = f"ours sort_min_rows={sort}"
                ours_decode(ours, batch, args.prompt, args.steps, args.kernels, label)
            layers.SORT_MIN_ROWS = default_sort


if __name__ == "__main__":
    main()
