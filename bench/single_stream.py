"""Single-stream prefill and greedy decode: deltaserve vs mlx-lm on the same checkpoint.

    python -m bench.single_stream --checkpoint small --prompt-len 512 --gen 64

Both run float32 on CPU with the same BLAS (the launcher preloads OpenBLAS for both, as
they share this process). Prints one JSON line per measurement and the ratios.
"""

from __future__ import annotations

import argparse
import json
import time

from deltaserve.kernels.cpu.blas import blas_summary, ensure_openblas


def _checkpoint(name: str) -> str:
    from deltaserve.models.testing import cached_checkpoint

    return name if "/" in name else str(cached_checkpoint(name))


def bench_ours(path: str, prompt: list[int], gen: int) -> dict:
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import GenerationRequest, SamplingParams
    from deltaserve.models.build import load_model

    config = EngineConfig(max_num_batched_tokens=2048, max_prefill_chunk=2048, warm_up_seconds=0)
    engine = LLMEngine(load_model(path), config)
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    engine.generate([prompt[:16]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    engine.add_request(GenerationRequest("b", tuple(prompt), params))
    start = time.perf_counter()
    first = None
    while engine.has_work():
        if engine.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"prefill_s": first - start, "decode_s": end - first}


def bench_mlx_lm(path: str, prompt: list[int], gen: int) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(path)
    if mx.default_device() == mx.cpu:  # same compute dtype as ours (float32 on CPU)
        model.set_dtype(mx.float32)
    for _, _ in zip(range(4), generate_step(mx.array(prompt[:16]), model), strict=False):
        pass  # warm-up
    start = time.perf_counter()
    first = None
    steps = generate_step(mx.array(prompt), model, prefill_step_size=2048)
    for _ in zip(range(gen), steps, strict=False):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"prefill_s": first - start, "decode_s": end - first}


def main() -> None:
    ensure_openblas()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default="small", help="cached test shape name or a path")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps({"blas": blas_summary()}))
    path = _checkpoint(args.checkpoint)
    prompt = [(i * 7919) % 200000 + 100 for i in range(args.prompt_len)]
    results = {}
    for name, fn in (("deltaserve", bench_ours), ("mlx_lm", bench_mlx_lm)):
        r = fn(path, prompt, args.gen)
        r["prefill_tok_s"] = args.prompt_len / r["prefill_s"]
        r["decode_tok_s"] = (args.gen - 1) / r["decode_s"]
        results[name] = r
        print(json.dumps({"impl": name, "checkpoint": args.checkpoint, **r}))
    ours, peer = results["deltaserve"], results["mlx_lm"]
    print(
        json.dumps(
            {
                "ratio_prefill": ours["prefill_tok_s"] / peer["prefill_tok_s"],
                "ratio_decode": ours["decode_tok_s"] / peer["decode_tok_s"],
            }
        )
    )


if __name__ == "__main__":
    main()
