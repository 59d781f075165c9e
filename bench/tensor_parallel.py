"""Tensor-parallel throughput and token equality: the same greedy batches on one process
and on a group (every rank runs this script; rank 0 measures).

    # one GPU (writes the reference tokens and figures)
    python -m bench.tensor_parallel --checkpoint 9B --batches 1 64 --out tp1.json
    # two GPUs, one host (NCCL): compare with the one-GPU run
    mlx.launch --backend nccl -n 2 bench/tensor_parallel.py --checkpoint 9B \\
        --batches 1 64 --out tp2.json --reference tp1.json

Prints one JSON line per batch size (tok/s, decode tok/s, TTFT p50, as
bench/engine_throughput.py measures them), and with --reference whether the greedy tokens
equal the reference run's and the decode ratio against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from deltaserve.kernels.cpu.blas import ensure_openblas


class _Engine:
    """bench.engine_throughput's impl protocol over one engine (reused: with several
    ranks, every engine built on rank 0 needs one built on each other rank)."""

    name = "deltaserve"

    def __init__(self, engine, margins: bool) -> None:  # deltaserve.engine.engine.LLMEngine
        self.engine = engine
        self.margins = margins  # record each token's top-1 minus top-2 logprob
        self.tokens: dict[int, list[int]] = {}
        self.gaps: dict[int, list[float]] = {}

    def run(self, prompts: list[list[int]], gens: list[int], on_token) -> None:
        import time

        from deltaserve.engine.types import GenerationRequest, SamplingParams

        self.tokens = {i: [] for i in range(len(prompts))}
        self.gaps = {i: [] for i in range(len(prompts))}
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
            params = SamplingParams(
                temperature=0.0, max_tokens=g, ignore_eos=True,
                logprobs=self.margins, top_logprobs=2 if self.margins else 0,
            )  # fmt: skip
            self.engine.add_request(GenerationRequest(str(i), tuple(p), params))
        while self.engine.has_work():
            deltas = self.engine.step()
            now = time.perf_counter()
            for d in deltas:
                if d.token_ids:
                    self.tokens[int(d.request_id)].extend(d.token_ids)
                    self.gaps[int(d.request_id)] += [
                        lp.top[0][1] - lp.top[1][1] for lp in d.logprobs or ()
                    ]
                    on_token(int(d.request_id), now)


def _compare(row: dict, ref: dict) -> dict:
    """Token equality with the reference run; where a row first differs, the reference's
    top-1 minus top-2 logprob there (a near tie, when tiny) if it recorded margins."""
    splits = []
    pairs = zip(row["tokens_digest"], ref["tokens_digest"], strict=True)
    for i, (mine, theirs) in enumerate(pairs):
        at = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        if at is not None:
            gaps = ref["gaps"][i]
            splits.append({"row": i, "token": at, "ref_gap": gaps[at] if at < len(gaps) else None})
    return {
        "tokens_equal_reference": row["tokens_digest"] == ref["tokens_digest"],
        "rows_differing": splits,
        "decode_vs_reference": row["decode_tok_s"] / ref["decode_tok_s"],
    }


def main() -> int:
    ensure_openblas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="9B", help="test checkpoint name or a path")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True, help="figures and tokens (JSON)")
    parser.add_argument("--reference", type=Path, help="another run's --out to compare with")
    parser.add_argument("--backend", default="any", help="mx.distributed backend to join")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help="default: deltaserve.models.build's"
    )
    parser.add_argument("--no-pipeline", action="store_true", help="one process, unpipelined")
    parser.add_argument("--margins", action="store_true", help="top-2 logprob gaps (slower)")
    args = parser.parse_args()

    import mlx.core as mx

    from bench.engine_throughput import throughput
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.parallel.tensor_parallel import follow, join_group, start_engine
    from deltaserve.models.testing import cached_checkpoint

    path = args.checkpoint if Path(args.checkpoint).is_dir() else cached_checkpoint(args.checkpoint)
    parallel = join_group(args.backend)
    config = EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, max_prefill_chunk=2048,
        memory_budget_bytes=40 << 30, prefix_cache=False, warm_up_seconds=0,
    )  # fmt: skip
    if args.no_pipeline:
        config = dataclasses.replace(config, pipeline_steps=False)
    dtype = getattr(mx, args.dtype) if args.dtype else None
    engine = start_engine(str(path), config, parallel, dtype)
    if parallel is not None and parallel.rank > 0:
        follow(engine)
        return 0
    impl = _Engine(engine, args.margins)
    ranks = 1 if parallel is None else parallel.size
    reference = json.loads(args.reference.read_text()) if args.reference else None
    results = []
    for batch in args.batches:
        row = throughput(impl, batch, args.gen, args.gen, args.prompt, args.prompt)
        row |= {"ranks": ranks, "tokens_digest": [impl.tokens[i] for i in sorted(impl.tokens)]}
        row["gaps"] = [impl.gaps[i] for i in sorted(impl.gaps)]
        if reference is not None:
            ref = next(r for r in reference if r["batch"] == batch)
            row |= _compare(row, ref)
        results.append(row)
        shown = {k: v for k, v in row.items() if k not in ("tokens_digest", "gaps")}
        print(json.dumps(shown), flush=True)
    args.out.write_text(json.dumps(results))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
