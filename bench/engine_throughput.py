"""Offline batched throughput: deltaserve's engine vs mlx-lm's BatchGenerator.

    python -m bench.engine_throughput --checkpoint small --batches 1 8 32
    python -m bench.engine_throughput --checkpoint small --itl  # ITL under a long prefill

Same checkpoint, dtype (float32 on CPU) and BLAS for both, in one process. Prints JSON
lines: tok/s (generated tokens over wall time), TTFT p50, and ratios against mlx-lm.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import TYPE_CHECKING

from deltaserve.kernels.cpu.blas import blas_summary, ensure_openblas

if TYPE_CHECKING:
    from deltaserve.engine.engine import LLMEngine


def _prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 200000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Ours:
    name = "deltaserve"

    def __init__(
        self,
        path: str,
        budget: int,
        chunk: int,
        pack: bool = True,
        float32: bool = False,
        **kw,
    ) -> None:
        """float32: load the weights in float32 (else the device's default: load_model)."""
        import mlx.core as mx

        from deltaserve.engine.config import EngineConfig
        from deltaserve.kernels.platform import prepare_device
        from deltaserve.models.build import load_model

        self.config = EngineConfig(
            max_num_seqs=min(64, budget),
            max_num_batched_tokens=budget,
            max_prefill_chunk=chunk,
            pack_token_wise=pack,
            # throughput() warms each measured shape with a run of its own before it; the
            # engine's start-up warm-up (60 s on a GPU) would trace shapes no run meets
            **{"warm_up_seconds": 0.0, **kw},
        )
        prepare_device(self.config)  # as the server does, before MLX's first GPU evaluation
        self.loaded = load_model(path, dtype=mx.float32 if float32 else None)
        self.engine: LLMEngine | None = None

    def make(self) -> LLMEngine:
        """The one engine every run of this object shares: mx.compile traces per engine (a
        compiled step is a bound method of it), so a fresh engine would trace its decode
        shapes inside the measured run that follows its warm-up, as a server that has run
        a while does not."""
        from deltaserve.engine.engine import LLMEngine

        if self.engine is None:
            self.engine = LLMEngine(self.loaded, self.config)
        return self.engine

    def run(self, prompts: list[list[int]], gens: list[int], on_token) -> None:
        from deltaserve.engine.types import GenerationRequest, SamplingParams

        engine = self.make()
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
            params = SamplingParams(temperature=0.0, max_tokens=g, ignore_eos=True)
            engine.add_request(GenerationRequest(str(i), tuple(p), params))
        while engine.has_work():
            now_deltas = engine.step()
            now = time.perf_counter()
            for d in now_deltas:
                if d.token_ids and d.request_id.isdigit():
                    on_token(int(d.request_id), now)

    def step_times(self) -> dict:
        """The engine's steps so far: per kind (count, summed seconds), and how many traced
        a compiled shape (a difference of two says what one run held). Reads the engine
        a run made and never makes one: a subclass's make() starts a run's records
        (bench.speculative's)."""
        from deltaserve.engine.api import STEP_KINDS

        assert self.engine is not None, "step_times() before a run"
        snap = self.engine.scheduler.step_times.snapshot()
        kinds = {k: (snap.counts[i][-1], snap.seconds[i]) for i, k in enumerate(STEP_KINDS)}
        return {"kinds": kinds, "traced": snap.traced}

    def add_late(self, prompt: list[int], gen: int) -> None:
        from deltaserve.engine.types import GenerationRequest, SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        self.engine.add_request(GenerationRequest("late", tuple(prompt), params))


class MlxLm:
    name = "mlx_lm"

    def __init__(self, path: str, budget: int, chunk: int, pack: bool = True) -> None:
        import mlx.core as mx
        import mlx_lm

        self.model, _ = mlx_lm.load(path)
        if mx.default_device() == mx.cpu:  # ours computes in float32 on CPU only
            self.model.set_dtype(mx.float32)
        self.chunk = chunk

    def run(self, prompts: list[list[int]], gens: list[int], on_token, late=None) -> None:
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(
            self.model, completion_batch_size=64, prefill_batch_size=8, prefill_step_size=self.chunk
        )
        uids = gen.insert(prompts, gens)
        index = {uid: i for i, uid in enumerate(uids)}
        step = 0
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                if r.uid in index:
                    on_token(index[r.uid], now)
            step += 1
            if late is not None and step == late[0]:
                gen.insert([late[1]], [late[2]])
        gen.close()


def throughput(
    impl,
    batch: int,
    gen_lo: int,
    gen_hi: int,
    plo: int,
    phi: int,
    warm_tokens: int | None = None,
    shift: int = 0,
) -> dict:
    """One warm-up run, then the measured one; `shift` moves both runs' prompt tokens (by
    2 x shift) so a repeat on a kept engine meets no prefix of an earlier call's prompts
    in its prefix cache."""
    prompts = [[t + 2 * shift for t in p] for p in _prompts(batch, plo, phi, seed=batch)]
    rng = random.Random(batch + 1)
    gens = [rng.randint(gen_lo, gen_hi) for _ in range(batch)]
    # Warm-up on the measured shapes (the same batch, prompt and answer lengths, other
    # tokens, so no prefix cache hit; warm_tokens each if given): steady state for both,
    # not first-use kernel compilation (NVRTC / Metal JIT) nor, for an engine kept across
    # runs (Ours), a compiled shape traced inside the measured run (a decode batch at each
    # KV capacity the rows grow through).
    warm = [[t + 1 for t in p] for p in prompts]
    impl.run(warm, gens if warm_tokens is None else [warm_tokens] * batch, lambda i, t: None)
    first: dict[int, float] = {}
    stamps: list[float] = []

    def on_token(i: int, now: float) -> None:
        stamps.append(now)
        first.setdefault(i, now)

    before = impl.step_times() if isinstance(impl, Ours) else None
    start = time.perf_counter()
    impl.run(prompts, gens, on_token)
    wall = time.perf_counter() - start
    steps = _steps_between(before, impl.step_times()) if before is not None else {}
    ttft = [t - start for t in first.values()]
    # Decode rate: tokens after every row has its first one, over that window.
    all_started = max(first.values())
    decode = [t for t in stamps if t > all_started]
    decode_window = (max(decode) - all_started) if decode else float("nan")
    return {
        "impl": impl.name,
        "batch": batch,
        "tokens": len(stamps),
        "tok_s": len(stamps) / wall,
        "decode_tok_s": len(decode) / decode_window if decode else float("nan"),
        "ttft_p50_s": _pct(ttft, 0.5),
        "wall_s": wall,
        **steps,
    }


RUNS = 3  # steady's most throughput() calls


def steady(impl, shape: tuple, shift: bool = True) -> dict:
    """throughput(impl, *shape) (a warm-up, then the measured run) again until its
    measured run traces no compiled shape, at most RUNS times; `runs` says how many it
    took. An engine traces a shape once in its life (a server in its start-up warm-up or
    its first busy seconds), but one warm-up run need not meet every shape the measured
    run does: the warm-up prefills before the step-cost model has learned anything, at
    the whole token budget, and the measured run's chunks beside decoding rows take
    other sizes (bench.gpu); a speculating engine's verify and draft widths follow which
    drafts land (bench.speculative). shift: each repeat on prompt tokens of its own, so
    no prefix-cache hit on an earlier call's (off for a caller whose runs must repeat the
    same prompts: bench.speculative's forced drafts are the plain run's outputs)."""
    row: dict = {}
    for runs in range(1, RUNS + 1):
        row = throughput(impl, *shape, shift=runs - 1 if shift else 0) | {"runs": runs}
        if not row.get("traced"):
            break
    return row


def _steps_between(before: dict, after: dict) -> dict:
    """What the measured run's steps were (Ours.step_times before and after it): per kind
    its count and mean ms, and the steps that traced a compiled shape inside it (each a
    one-off a server that has run a while does not pay)."""
    kinds = {}
    for kind, (count, seconds) in after["kinds"].items():
        n, s = count - before["kinds"][kind][0], seconds - before["kinds"][kind][1]
        if n:
            kinds[kind] = {"n": n, "mean_ms": round(1e3 * s / n, 2)}
    return {"steps": kinds, "traced": after["traced"] - before["traced"]}


ARRIVAL_STEP = 40  # row 0's token count when the long prompt arrives


def itl_under_prefill(impl, long_len: int) -> dict:
    """8 rows decode; then a long prompt arrives. ITL before vs during its prefill."""
    prompts = _prompts(8, 128, 128, seed=5)
    long_prompt = _prompts(1, long_len, long_len, seed=6)[0]
    stamps: dict[int, list[float]] = {i: [] for i in range(8)}
    state = {"steps": 0, "arrived": None}

    def on_token(i: int, now: float) -> None:
        if i in stamps:
            stamps[i].append(now)

    if isinstance(impl, Ours):

        def hook(i: int, now: float) -> None:
            on_token(i, now)
            if i == 0:
                state["steps"] += 1
                if state["steps"] == ARRIVAL_STEP:
                    impl.add_late(long_prompt, 4)
                    state["arrived"] = now

        impl.run(prompts, [120] * 8, hook)
    else:

        def hook(i: int, now: float) -> None:
            on_token(i, now)
            if i == 0:
                state["steps"] += 1
                if state["steps"] == ARRIVAL_STEP:
                    state["arrived"] = now

        impl.run(prompts, [120] * 8, hook, late=(ARRIVAL_STEP, long_prompt, 4))
    arrived = state["arrived"]
    # Decode-only baseline: intervals after every row has its first token (so no prompt
    # of the 8 is still prefilling) and before the long prompt arrives.
    all_decoding = max(ts[0] for ts in stamps.values())
    before, during = [], []
    for ts in stamps.values():
        for a, b in zip(ts, ts[1:], strict=False):
            if b <= arrived:
                if a >= all_decoding:
                    before.append(b - a)
            else:
                during.append(b - a)
    return {
        "impl": impl.name,
        "long_prompt": long_len,
        "itl_decode_only_p50_ms": 1e3 * _pct(before, 0.5),
        "itl_decode_only_p99_ms": 1e3 * _pct(before, 0.99),
        "itl_during_prefill_p50_ms": 1e3 * _pct(during, 0.5),
        "itl_during_prefill_p99_ms": 1e3 * _pct(during, 0.99),
        "itl_max_ms": 1e3 * max(during + before),
    }


def main() -> None:
    ensure_openblas()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--gen", type=int, nargs=2, default=[64, 128])
    ap.add_argument("--budget", type=int, default=1024, help="our per-step token budget")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (both)")
    ap.add_argument("--itl", action="store_true", help="run the latency-under-prefill test")
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--no-pack", action="store_true", help="ours: MLP per group, not packed")
    ap.add_argument("--only", choices=["deltaserve", "mlx_lm"], default=None)
    args = ap.parse_args()
    from deltaserve.models.testing import cached_checkpoint

    path = args.checkpoint if "/" in args.checkpoint else str(cached_checkpoint(args.checkpoint))
    print(json.dumps({"blas": blas_summary(), "checkpoint": args.checkpoint}))
    impls = [
        cls(path, args.budget, args.chunk, not args.no_pack)
        for cls in (Ours, MlxLm)
        if args.only in (None, cls.name)
    ]
    if args.itl:
        for impl in impls:
            print(json.dumps(itl_under_prefill(impl, args.long)), flush=True)
        return
    for batch in args.batches:
        rows = [throughput(i, batch, *args.gen, *args.prompt) for i in impls]
        for r in rows:
            print(json.dumps(r), flush=True)
        if len(rows) == 2:
            print(
                json.dumps(
                    {
                        "batch": batch,
                        "ratio_tok_s": rows[0]["tok_s"] / rows[1]["tok_s"],
                        "ratio_ttft_p50": rows[0]["ttft_p50_s"] / rows[1]["ttft_p50_s"],
                    }
                )
            )


if __name__ == "__main__":
    main()
