"""GPU table: deltaserve's engine vs mlx-lm's BatchGenerator, same process, random weights
at the published Qwen3.5 shapes.

    python -m bench.gpu --shape 0.8B --batches 1 8 32 64 --prompt 128 --gen 128
    python -m bench.gpu --shape 9B --batches 1 16 64 --prompt 512 --gen 128
    python -m bench.gpu --shape 35B-A3B-mlx-4bit --batches 1 16 --prompt 512 --gen 128

Per batch size: tok/s over the whole run, decode tok/s (after every row has its first
token), TTFT p50, and the decode rate as a share of the HBM roofline (every step reads the
weights once, only the experts its tokens route to for MoE, plus each row's state; --hbm
bytes/s). Before timing, it checks that the
compiled decode step gives the uncompiled step's greedy tokens on this device. Prints JSON
lines, then one markdown table; --out also writes the JSON lines to a file.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.engine_throughput import MlxLm, Ours, steady


def roofline_tok_s(weight_bytes: float, row_bytes: int, batch: int, hbm: float) -> float:
    """Decode tokens/s if a step cost only its memory traffic: weights + B rows of state."""
    return batch * hbm / (weight_bytes + batch * row_bytes)


def step_weight_bytes(loaded, batch: int) -> float:
    """Weight bytes one decode step of `batch` rows reads. Dense: all of them. MoE: all but
    the routed experts, plus the expected number of distinct experts that B tokens with
    top-k picks each touch, E (1 - (1 - k/E)^B) (uniform routing, as random weights give)."""
    import mlx.nn as nn

    from deltaserve.models.layers import SparseMoE

    total = loaded.weight_bytes()
    for layer in loaded.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            experts = layer.mlp.experts
            size = sum(v.nbytes for _, v in nn.utils.tree_flatten(experts.parameters()))
            count = layer.mlp.gate.weight.shape[0]  # router rows = experts (packed or not)
            used = count * (1 - (1 - layer.mlp.top_k / count) ** batch)
            total -= size * (1 - used / count)
    return total


def check_compiled(ours: Ours, prompt_len: int) -> dict:
    """Greedy tokens of 8 rows with and without the compiled decode step."""
    import dataclasses

    from bench.engine_throughput import _prompts
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import SamplingParams

    prompts = _prompts(8, prompt_len // 2, prompt_len, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = {}
    for compiled in (False, True):
        config = dataclasses.replace(ours.config, compile_decode=compiled)
        runs[compiled] = [
            c.token_ids for c in LLMEngine(ours.loaded, config).generate(prompts, params)
        ]
    same = sum(a == b for a, b in zip(runs[False], runs[True], strict=True))
    return {"check": "compiled == uncompiled greedy", "rows_equal": same, "rows": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--shape",
        default="0.8B",
        help="a deltaserve.models.testing shape/checkpoint name or a path",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048, help="our per-step token budget")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--hbm", type=float, default=4.3e12, help="HBM bytes/s (H200 measured)")
    ap.add_argument(
        "--stall",
        type=float,
        default=None,
        help="our max_stall_factor (default: the engine's; 0: prompts at the token budget)",
    )
    ap.add_argument("--only", choices=["deltaserve", "mlx_lm"], default=None)
    ap.add_argument("--no-check", action="store_true", help="skip the compiled==uncompiled check")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import mlx.core as mx

    from deltaserve.models.testing import cached_checkpoint

    start = time.perf_counter()
    path = args.shape if "/" in args.shape else str(cached_checkpoint(args.shape))
    lines = [
        {
            "shape": args.shape,
            "device": str(mx.default_device()),
            "write_s": time.perf_counter() - start,
        }
    ]
    impls = []
    if args.only in (None, "deltaserve"):
        stall = {} if args.stall is None else {"max_stall_factor": args.stall}
        ours = Ours(path, args.budget, args.chunk, pack=False, **stall)
        impls.append(ours)
        if not args.no_check:
            lines.append(check_compiled(ours, args.prompt))
        row = ours.make().budget.row_bytes(args.prompt + args.gen // 2)
    if args.only in (None, "mlx_lm"):
        impls.append(MlxLm(path, args.budget, args.chunk))
    for line in lines:
        print(json.dumps(line), flush=True)
    table = []
    for batch in args.batches:
        results = {}
        for impl in impls:
            r = steady(impl, (batch, args.gen, args.gen, args.prompt, args.prompt))
            if args.only != "mlx_lm":
                r["roofline_pct"] = (
                    100
                    * r["decode_tok_s"]
                    / roofline_tok_s(step_weight_bytes(ours.loaded, batch), row, batch, args.hbm)
                )
            results[impl.name] = r
            lines.append(r)
            print(json.dumps(r), flush=True)
        table.append((batch, results))
    _print_table(args.shape, args.prompt, args.gen, table)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


def _print_table(shape: str, prompt: int, gen: int, table: list) -> None:
    print(
        "\n| shape | B | ours tok/s | mlx-lm tok/s | ratio | ours decode tok/s "
        "| mlx-lm decode tok/s | decode ratio | ours TTFT p50 s | mlx-lm TTFT p50 s "
        "| ours % HBM roofline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, r in table:
        o, m = r.get("deltaserve"), r.get("mlx_lm")

        def f(x: dict | None, key: str, fmt: str = "{:.1f}") -> str:
            return fmt.format(x[key]) if x else "-"

        ratio = f"{o['tok_s'] / m['tok_s']:.2f}x" if o and m else "-"
        dratio = f"{o['decode_tok_s'] / m['decode_tok_s']:.2f}x" if o and m else "-"
        print(
            f"| {shape} p{prompt}/g{gen} | {batch} | {f(o, 'tok_s')} | {f(m, 'tok_s')} | {ratio} "
            f"| {f(o, 'decode_tok_s')} | {f(m, 'decode_tok_s')} | {dratio} "
            f"| {f(o, 'ttft_p50_s', '{:.3f}')} | {f(m, 'ttft_p50_s', '{:.3f}')} "
            f"| {f(o, 'roofline_pct', '{:.1f}%')} |"
        )


if __name__ == "__main__":
    main()
