"""Soak: many requests over random shared prefixes; the row-state memory never leaves the budget.

    python -m bench.prefix_soak --checkpoint small --requests 1000 --budget-mib 256

Offline engine (default config apart from the budget and prefix_min_tokens 128; float32
weights with OpenBLAS as the BLAS on the CPU, as the other benchmarks and the server run),
`--concurrency` requests in flight, each a random one of `--prefixes` shared prefixes
(128-1,024 tokens, passed as its prefix_hint, as a chat's history is) plus its own suffix
(1-128 tokens) and output length (4-32). After every step it reads what the states really hold
(RowStates.nbytes: decode batch with its padding, prefill states, prefix cache) and checks
it against the budget, and that the cache's arrays are exactly what its index reserved.
Prints one JSON line: peak bytes over the budget, hit rate, evictions, violations.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from deltaserve.kernels.cpu.blas import ensure_openblas


def _workload(args: argparse.Namespace) -> list[tuple[list[int], int, int]]:
    """(prompt, its shared prefix length, max_tokens) per request."""
    rng = random.Random(args.seed)
    heads = [
        [rng.randrange(100, 240000) for _ in range(rng.randint(128, 1024))]
        for _ in range(args.prefixes)
    ]
    out = []
    for _ in range(args.requests):
        head = rng.choice(heads)
        suffix = [rng.randrange(100, 240000) for _ in range(rng.randint(1, 128))]
        out.append((head + suffix, len(head), rng.randint(4, 32)))
    return out


def soak(args: argparse.Namespace) -> dict:
    # imported here, after ensure_openblas (it restarts the process before mlx loads)
    from bench.server_vs_mlxlm import _f32_copy
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import GenerationRequest, SamplingParams
    from deltaserve.models.build import load_model
    from deltaserve.models.testing import cached_checkpoint

    # bf16 on the CPU never reaches BLAS: 100 requests took 312 s (2.3 s a step)
    loaded = load_model(_f32_copy(cached_checkpoint(args.checkpoint)))
    config = EngineConfig(
        memory_budget_bytes=args.budget_mib * 2**20, prefix_min_tokens=128, warm_up_seconds=0
    )
    engine = LLMEngine(loaded, config)
    pending = _workload(args)
    total, steps, peak, violations, mismatches = len(pending), 0, 0, 0, 0
    done = 0
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and len(engine.scheduler.waiting) + engine.scheduler.num_running < (
            args.concurrency
        ):
            prompt, shared, max_tokens = pending.pop()
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            rid = f"r{len(pending)}"
            engine.add_request(GenerationRequest(rid, tuple(prompt), params, prefix_hint=shared))
        done += sum(1 for d in engine.step() if d.finished)
        held = engine.states.nbytes()
        peak = max(peak, held)
        violations += held > engine.budget.total
        if engine.prefix_cache is not None:
            mismatches += engine.states.prefix.nbytes() != engine.prefix_cache.stats.nbytes
        steps += 1
    stats = engine.prefix_cache.stats if engine.prefix_cache else None
    return {
        "checkpoint": args.checkpoint,
        "requests": total,
        "finished": done,
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 1),
        "budget_mib": args.budget_mib,
        "peak_state_mib": round(peak / 2**20, 1),
        "peak_over_budget": round(peak / engine.budget.total, 3),
        "steps_over_budget": violations,
        "cache_accounting_mismatches": mismatches,
        "hit_rate": round(stats.hit_tokens / max(stats.lookup_tokens, 1), 3) if stats else 0,
        "evictions": stats.evictions if stats else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="small")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prefixes", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ensure_openblas()
    print(json.dumps(soak(args)), flush=True)


if __name__ == "__main__":
    main()
