"""What a prompt chunk costs next to decode rows and alone, by chunk size (engine, no HTTP).

    python -m bench.chunk_cost --checkpoint small --sizes 16 56 160

The question behind issue 11's TTFT target: under the stall bound a long prompt advances
in chunks of the size a step's margin allows (~50 tokens next to 8 rows on the CPU), so
its TTFT under load against alone is about (decode step + margin) / margin times what a
token costs in such a chunk over what it costs in the 512-token chunks of a prompt alone.

Phase 1: `--rows` rows decode; a `--prompt`-token prompt prefills with decode-only and
mixed steps alternating (the chunk size cycling through `--sizes`), so the box's drift
reaches both kinds alike; a size's residual is its median mixed step less the median
decode-only step. Phase 2: the rows are gone; the same prompt length prefills alone with
the chunk size cycling through the sizes and 512. Everything in one process, the
scheduler's chunk sizes forced (its stall bound off). Prints one JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from deltaserve.kernels.cpu.blas import ensure_openblas

if TYPE_CHECKING:  # imported in run(), after ensure_openblas
    from deltaserve.engine.engine import LLMEngine


def _prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1000, 50000) for _ in range(n))


def _prefill(engine: LLMEngine, request_id: str, pick: Callable[[int], int], times: dict) -> None:
    """Run steps until `request_id` is done; step k runs a chunk of pick(k) tokens (0: a
    decode-only step) and its wall time goes to times[pick(k)]."""
    forced = {"tokens": 0}
    engine.scheduler.stall.allowance = lambda: forced["tokens"]
    step = 0
    while any(r.request_id == request_id for r in engine.scheduler.rows.values()) or (
        engine.scheduler.waiting
    ):
        forced["tokens"] = pick(step)
        start = time.perf_counter()
        engine.step()
        times[forced["tokens"]].append(time.perf_counter() - start)
        step += 1


def run(args: argparse.Namespace) -> list[dict]:
    from bench.server_vs_mlxlm import _f32_copy
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import GenerationRequest, SamplingParams
    from deltaserve.models.build import load_model
    from deltaserve.models.testing import cached_checkpoint

    loaded = load_model(_f32_copy(cached_checkpoint(args.checkpoint)))
    config = EngineConfig(max_stall_factor=0, max_num_seqs=args.rows + 1, warm_up_seconds=0)
    engine = LLMEngine(loaded, config)
    rng = random.Random(0)
    endless = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(args.rows):
        engine.add_request(GenerationRequest(f"row-{i}", _prompt(rng, 112), endless))
    for _ in range(20):  # admitted, prefilled, decoding
        engine.step()
    sizes, mixed, one = args.sizes, defaultdict(list), SamplingParams(max_tokens=1)
    for rep in range(args.repeat):
        engine.add_request(GenerationRequest(f"m{rep}", _prompt(rng, args.prompt), one))
        _prefill(engine, f"m{rep}", lambda k: sizes[k // 2 % len(sizes)] if k % 2 else 0, mixed)
    for i in range(args.rows):
        engine.abort(f"row-{i}")
    while engine.has_work():
        engine.step()
    alone_sizes, alone = [*sizes, 512], defaultdict(list)
    for rep in range(args.repeat):
        engine.add_request(GenerationRequest(f"a{rep}", _prompt(rng, args.prompt), one))
        _prefill(engine, f"a{rep}", lambda k: alone_sizes[k % len(alone_sizes)], alone)
    decode = statistics.median(mixed[0])
    rows = []
    for size in alone_sizes:
        row = {"tokens": size, "alone_ms": round(1e3 * statistics.median(alone[size]), 1)}
        row["alone_ms_per_token"] = round(row["alone_ms"] / size, 3)
        if size in mixed:
            residual = 1e3 * (statistics.median(mixed[size]) - decode)
            row.update(decode_step_ms=round(1e3 * decode, 1), residual_ms=round(residual, 1))
            row["residual_over_alone"] = round(residual / row["alone_ms"], 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="small")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 56, 160])
    parser.add_argument("--rows", type=int, default=8, help="decoding rows in phase 1")
    parser.add_argument("--prompt", type=int, default=4000, help="prompt tokens")
    parser.add_argument("--repeat", type=int, default=3, help="prompts per phase")
    args = parser.parse_args()
    ensure_openblas()
    for row in run(args):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
