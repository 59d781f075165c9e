"""Constrained decoding costs: the grammar engine choice, and the engine's step time.

    python -m bench.constrained engines                    # llguidance vs xgrammar
    python -m bench.constrained step --checkpoint small --rows 32

engines: both libraries on the checkpoint's tokenizer (Qwen3.5, 248,320 logits) and the
84 schemas of tests/data/json_schema_suite.json: tokenizer set-up, schema compile times,
how many compile, the per-token mask time over random walks (one matcher), and one mask
for 32 rows at once (each library's parallel batch call). xgrammar is optional (not a
dependency): without it only llguidance is measured.

step: one engine, rows decoding free vs the same rows under a JSON schema whose long
string keeps them going; the mean step time over steps where all rows decode (after the
prefill), their ratio, and the grammar's cost per row: the mask computation (llguidance,
timed around RowConstraints.masks) and the mask's application in the sampler (timed
alone on [rows, V] logits). Prints JSON lines. OpenBLAS is preloaded on Linux CPU.

Measured 2026-11-30, small shape, 32 rows, 24 steps, medians of 3 alternating runs on
the shared 2-core machine (load ~2, this benchmark's own):
    greedy         free 135.9 ms, constrained 156.6 ms: 1.15x (1.07x in another run)
    temperature 1  free 332.6 ms, constrained 308.3 ms: 0.93x (noise: sampling dominates)
    greedy, --cache-limit-mb 32 (mlx-cpu's default): 149.6 vs 190.5 ms, 1.27x
    mask per row: computed 0.05-0.07 ms (llguidance), applied 0.25-0.34 ms
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from statistics import mean, median

from deltaserve.kernels.cpu.blas import blas_summary, ensure_openblas

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "json_schema_suite.json"
EOS = (248046, 248044)
# A JSON row that cannot end within the run: its string is long (minLength), so every
# step keeps all rows decoding, under a mask as busy as a string's.
LONG_STRING = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "text": {"type": "string", "minLength": 2000}},
    "required": ["id", "text"],
    "additionalProperties": False,
}


def _schemas() -> list[dict]:
    return [entry["schema"] for entry in json.loads(CORPUS.read_text(encoding="utf-8"))]


def _allowed(row, vocab: int) -> list[int]:
    from deltaserve.engine.structured.token_mask import allowed_ids

    return [int(t) for t in allowed_ids(row, vocab)]


def _pcts(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    at = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6)  # noqa: E731
    return {"p50_us": at(0.5), "p90_us": at(0.9), "p99_us": at(0.99), "n": len(ordered)}


# -- engines --------------------------------------------------------------------------------
def bench_llguidance(tokenizer_json: Path, vocab: int, rows: int) -> dict:
    import llguidance as llg
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    start = time.perf_counter()
    tok = llg.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=list(EOS))
    out = {"engine": "llguidance", "init_s": round(time.perf_counter() - start, 2)}
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compiled, times, errors = [], [], []
    for schema in _schemas():
        start = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        matcher = llg.LLMatcher(tok, grammar, log_level=0)
        times.append(time.perf_counter() - start)
        (errors if matcher.is_error() else compiled).append(matcher.get_error() or matcher)
    out |= _compile_stats(times, len(compiled), errors)
    mask = allocate_token_bitmask(1, vocab)

    def fill(matcher: object) -> object:
        fill_next_token_bitmask(matcher, mask, 0)
        return mask

    walk = lambda m, t: m.consume_token(t)  # noqa: E731
    fresh = lambda i: compiled[i % len(compiled)].deep_copy()  # noqa: E731
    out["mask_per_token"] = _pcts(_walks(len(compiled), fresh, fill, walk, vocab))
    executor = llg.LLExecutor(num_threads=os.cpu_count())
    batch = allocate_token_bitmask(rows, vocab)
    ptr, size = batch.ctypes.data, batch.shape[1] * 4

    def fill_batch(matchers: list) -> object:
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], ptr, size, rows)
        return batch

    out[f"mask_batch_{rows}"] = _pcts(_batch_walks(rows, fresh, fill_batch, walk, vocab))
    return out


def bench_xgrammar(tokenizer_json: Path, vocab: int, rows: int) -> dict | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    start = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(EOS))
    compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count(), cache_enabled=False)
    out = {"engine": "xgrammar", "init_s": round(time.perf_counter() - start, 2)}
    compiled, times, errors = [], [], []
    for schema in _schemas():
        start = time.perf_counter()
        try:
            grammar = compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True
            )
            compiled.append(grammar)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError variants
            errors.append(str(exc).splitlines()[0])
        times.append(time.perf_counter() - start)
    out |= _compile_stats(times, len(compiled), errors)
    # Keywords llguidance refuses by name: does xgrammar compile them (dropping them)?
    probes = {"propertyNames": {"type": "object", "propertyNames": {"maxLength": 3}}}
    probes["dependentSchemas"] = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}
    probes["not"] = {"type": "string", "not": {"const": "a"}}
    out["compiles_unsupported"] = [k for k, s in probes.items() if _compiles(compiler, s)]
    mask = xgr.allocate_token_bitmask(1, vocab)

    def fill(matcher: object) -> object:
        matcher.fill_next_token_bitmask(mask, 0)
        return mask.numpy()

    walk = lambda m, t: m.accept_token(t)  # noqa: E731
    fresh = lambda i: xgr.GrammarMatcher(compiled[i % len(compiled)])  # noqa: E731
    out["mask_per_token"] = _pcts(_walks(len(compiled), fresh, fill, walk, vocab))
    batch = xgr.allocate_token_bitmask(rows, vocab)
    batcher = xgr.BatchGrammarMatcher(max_threads=os.cpu_count())

    def fill_batch(matchers: list) -> object:
        batcher.batch_fill_next_token_bitmask(matchers, batch)
        return batch.numpy()

    out[f"mask_batch_{rows}"] = _pcts(_batch_walks(rows, fresh, fill_batch, walk, vocab))
    return out


def _compiles(compiler: object, schema: dict) -> bool:
    try:
        compiler.compile_json_schema(json.dumps(schema))
        return True
    except Exception:
        return False


def _compile_stats(times: list[float], ok: int, errors: list[str]) -> dict:
    return {
        "compile_total_s": round(sum(times), 3),
        "compile_mean_ms": round(mean(times) * 1e3, 2),
        "compile_max_ms": round(max(times) * 1e3, 1),
        "compiled": ok,
        "refused": len(errors),
        "errors": sorted({e[:80] for e in errors}),
    }


def _walks(count: int, fresh, fill, consume, vocab: int, steps: int = 48) -> list[float]:
    """Seconds per mask (fill only) along a random walk (uniform over the allowed tokens)
    of each of `count` matchers."""
    rng, times = random.Random(0), []
    for i in range(count):
        matcher = fresh(i)
        for _ in range(steps):
            start = time.perf_counter()
            bits = fill(matcher)
            times.append(time.perf_counter() - start)
            token = rng.choice(_allowed(bits[0], vocab))
            if token in EOS or not consume(matcher, token):
                break
    return times


def _batch_walks(rows: int, fresh, fill_batch, consume, vocab: int, steps: int = 24) -> list:
    """Seconds per batched mask of `rows` matchers walking at random (a finished one is
    replaced by a fresh matcher of the next schema)."""
    rng, times, made = random.Random(0), [], rows
    matchers = [fresh(i) for i in range(rows)]
    for _ in range(steps):
        start = time.perf_counter()
        bits = fill_batch(matchers)
        times.append(time.perf_counter() - start)
        for i, matcher in enumerate(matchers):
            token = rng.choice(_allowed(bits[i], vocab))
            if token in EOS or not consume(matcher, token):
                matchers[i], made = fresh(made), made + 1
    return times


def _timed_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(median(times) * 1e3, 2)


# -- engine step ----------------------------------------------------------------------------
def bench_step(
    path: str, rows: int, steps: int, temperature: float, cache_mb: int | None, repeats: int
) -> None:
    """Free and constrained runs alternate `repeats` times (the machine's other load
    drifts); the ratio is of the median step times."""
    import mlx.core as mx

    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.structured.spec import Constraint
    from deltaserve.models.build import load_model

    loaded = load_model(path)
    config = EngineConfig(
        max_num_seqs=rows, max_num_batched_tokens=max(512, rows * 16), warm_up_seconds=0
    )
    engine = LLMEngine(loaded, config)
    if cache_mb is not None:  # after the engine, which raises it on CPU
        mx.set_cache_limit(cache_mb << 20)
    engine.grammar_compiler().tokenizer  # noqa: B018 - load before timing
    spec = Constraint("json_schema", schema=LONG_STRING)
    runs: dict[str, list[dict]] = {"free": [], "constrained": []}
    for _ in range(repeats):
        runs["free"].append(_steady_steps(engine, rows, steps, temperature, None))
        runs["constrained"].append(_steady_steps(engine, rows, steps, temperature, spec))
    for name, results in runs.items():
        line = {"rows": rows, "temperature": temperature, "run": name, "repeats": results}
        print(json.dumps(line))
    free = median(r["step_ms"] for r in runs["free"])
    constrained = median(r["step_ms"] for r in runs["constrained"])
    mask_ms = median(r["mask_ms"] for r in runs["constrained"])
    summary = {
        "free_step_ms": free,
        "constrained_step_ms": constrained,
        "ratio": round(constrained / free, 3),
        "mask_compute_ms_per_row": round(mask_ms / rows, 3),
        "mask_apply_ms_per_row": round(_apply_ms(rows, loaded.config.vocab_size) / rows, 3),
    }
    print(json.dumps(summary))


def _steady_steps(engine, rows: int, steps: int, temperature: float, spec) -> dict:
    """Mean wall time of the steps where all `rows` decode and nothing prefills, and of
    the mask computation inside them."""
    from deltaserve.engine.types import GenerationRequest, SamplingParams

    rng = random.Random(0)
    for i in range(rows):
        params = SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=steps + 8,
            ignore_eos=spec is None,
            constraint=spec,
        )
        prompt = tuple(rng.randrange(100, 200000) for _ in range(16))
        engine.add_request(GenerationRequest(f"{'c' if spec else 'f'}{i}", prompt, params))
    masks, timed = engine.constraints.masks, {"s": 0.0}

    def timed_masks(keys):  # the bench's probe around the engine's mask computation
        start = time.perf_counter()
        try:
            return masks(keys)
        finally:
            timed["s"] += time.perf_counter() - start

    engine.constraints.masks = timed_masks
    step_s, mask_s = [], []
    while engine.has_work():
        sched = engine.scheduler
        steady = len(sched.state.decoding) == rows and not (sched.waiting or sched.state.prefilling)
        timed["s"] = 0.0
        start = time.perf_counter()
        engine.step()
        if steady:
            step_s.append(time.perf_counter() - start)
            mask_s.append(timed["s"])
    engine.constraints.masks = masks
    steady = step_s[2:]  # the first steady steps still carry pipeline start-up
    return {
        "step_ms": round(mean(steady) * 1e3, 2),
        "mask_ms": round(mean(mask_s[2:]) * 1e3, 2),
        "steady_steps": len(steady),
    }


def _apply_ms(rows: int, vocab: int) -> float:
    import mlx.core as mx
    import numpy as np

    from deltaserve.engine.structured.token_mask import apply_token_mask

    logits = mx.random.normal((rows, vocab))
    bits = np.random.default_rng(0).integers(-(2**31), 2**31, (rows, (vocab + 31) // 32))
    bits = bits.astype(np.int32)
    mx.eval(logits)
    return _timed_ms(lambda: mx.eval(apply_token_mask(logits, bits)))


def main() -> None:
    ensure_openblas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=["engines", "step"])
    ap.add_argument(
        "--checkpoint", default="small", help="a deltaserve.models.testing checkpoint name"
    )
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run (step mode)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3, help="alternating free/constrained runs")
    ap.add_argument(
        "--cache-limit-mb", type=int, default=None, help="override the engine's MLX cache limit"
    )
    args = ap.parse_args()
    from deltaserve.models.testing import cached_checkpoint

    path = cached_checkpoint(args.checkpoint)
    load = os.getloadavg()[0]
    head = {"blas": blas_summary(), "checkpoint": args.checkpoint, "load1": load}
    print(json.dumps(head | {"cache_limit_mb": args.cache_limit_mb}))
    if args.mode == "engines":
        config = json.loads((path / "config.json").read_text())
        vocab = config.get("text_config", config)["vocab_size"]
        for bench in (bench_llguidance, bench_xgrammar):
            result = bench(path / "tokenizer.json", vocab, args.rows)
            if result is not None:
                print(json.dumps(result))
    else:
        bench_step(
            str(path), args.rows, args.steps, args.temperature, args.cache_limit_mb, args.repeats
        )


if __name__ == "__main__":
    main()
