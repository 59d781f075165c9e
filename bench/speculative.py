"""Speculative decoding (the MTP head, `speculative="mtp"`) against plain decoding.

    python -m bench.speculative --checkpoint small --batches 1 8 64 --prompt 128 --gen 128 \
        --k 2 --accept real 0.8 0.6

One process, one loaded model: per batch size B, B greedy requests at once through the
engine without speculation, then through the engine with it once per --accept mode; each
engine warmed up first on the measured shapes (bench.engine_throughput's `throughput`:
the same prompt lengths and token counts, other tokens) and kept for the measured
run, so its compiled steps are traced before it; the pair runs again (up to three
times) while the measured run still traced a shape, one-offs a server meets once
(bench.engine_throughput's `steady`). Prints JSON lines (decode tok/s: tokens
after every row has its first; total tok/s; TTFT p50; drafts verified and accepted and
their rate; whether the outputs equal the plain run's, token for token) and the ratios
with/without, then a table.

Why a forced mode: the test checkpoints have random weights, so their MTP head drafts
almost nothing right (--accept real, labelled so) and the figures only say what a
rejected draft costs. `--accept 0.8` makes the drafter propose each row's true greedy
continuation (the plain run's outputs for the same requests: greedy, deterministic), each
draft token independently replaced by a wrong one with probability 1 - 0.8 (seeded),
labelled "forced 80%". The head still runs and keeps its store as usual, so a step costs
what it would with a real head that drafts this well; the engine's own acceptance rule
decides, and the measured rate (accepted / drafted) is below 0.8 since a draft after a
wrong one is never accepted (expected p + p^2 of 2 for k = 2: 72% at p = 0.8).

Forced drafts match only while the speculative run computes exactly what the plain run
did: on a GPU in bf16 a verify's shape rounds differently from a decode step's, a near
tie of random weights flips a token, and from there no forced draft matches (hence
`--dtype float32`, with TF32 off on CUDA). float32 misprices large batches, though: a
verify's B x (k + 1) rows make its float32 matmuls compute-bound where bf16 uses tensor
cores. `--imposed` measures speed in any dtype instead: each verify's drafts are
rewritten, once its logits are computed, to the target's own argmax where kept (with
probability --accept each, seeded) and to a wrong token after, so the engine's
acceptance rule keeps each row's leading run of kept drafts. The verify forward ran on
the head's own drafts, so the state it keeps and the tokens emitted are not the plain
run's ("imposed 80%", same output "n/a"): speed only, with every step the engine takes
at that acceptance (verify, rollback, the next draft from the kept pairs) as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from bench.engine_throughput import Ours, steady
from deltaserve.kernels.cpu.blas import blas_summary, ensure_openblas

if TYPE_CHECKING:  # MLX is imported after ensure_openblas (main), so lazily below
    import mlx.core as mx

    from deltaserve.engine.api import StepTimes
    from deltaserve.engine.cache.batch import BatchState
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.plan import StepPlan
    from deltaserve.engine.sampling.sampler import SamplingRow
    from deltaserve.engine.speculative import DraftRound, Verdicts, VerifyStep
    from deltaserve.engine.types import RequestOutput
    from deltaserve.models.build import LoadedModel

OnToken = Callable[[int, float], None]
RATIOS = ("ratio_decode_tok_s", "ratio_tok_s", "ratio_ttft_p50_s")  # with / without


class Engine(Ours):
    """bench.engine_throughput's `Ours` on an already loaded model and a given config,
    counting every token (a verify step's delta carries up to k + 1), keeping each
    request's tokens (`outputs`), and with `accept` set, forcing the drafts (module
    docstring) from `oracle`."""

    def __init__(
        self,
        name: str,
        loaded: LoadedModel,
        config: EngineConfig,
        accept: float | None = None,
        oracle: list[dict[int, list[int]]] | None = None,
        seed: int = 0,
        always: bool = False,
        time_drafts: bool = False,
        imposed: bool = False,
    ) -> None:
        """time_drafts: the device synchronised around each verify step's draft chain, so
        its time is measured apart (`draft_ms`); it then no longer overlaps the rest.
        imposed: `accept` is imposed on each verify's drafts after its forward (module
        docstring) rather than drafting the oracle's tokens."""
        self.name, self.loaded, self.config = name, loaded, config
        self.accept, self.oracle, self.seed = accept, oracle, seed
        self.always, self.time_drafts, self.imposed = always, time_drafts, imposed
        self._drafts_s: list[float] = []  # each draft chain's time, this run
        self._chained = 0  # verify steps chained onto the one computing, this run
        self.outputs: dict[int, list[int]] = {}
        self.runs: list[dict[int, list[int]]] = []  # each run's outputs (warm-up first)
        self._counts: dict[int, int] = {}  # tokens per request in the last step
        self.engine: LLMEngine | None = None
        self.before: StepTimes | None = None  # the step times before the last run

    def make(self) -> LLMEngine:
        """One engine for the warm-up and the measured run: mx.compile traces per engine
        (each compiled step is a bound method of it), so a fresh engine would trace its
        decode, verify and draft shapes inside the measured run. The speculation counters
        restart with each run; what the policy learned (its break-even) stays, as in a
        running server."""
        from deltaserve.engine.scheduling.speculation import SpeculationStats

        self.outputs, self._counts, self._drafts_s, self._chained = {}, {}, [], 0
        self.runs.append(self.outputs)
        if self.engine is None:
            self.engine = self._build()
        elif self.engine.speculation is not None:
            self.engine.speculation.stats = SpeculationStats()
        self.before = self.engine.scheduler.step_times.snapshot()
        return self.engine

    def steps(self) -> dict:
        """The last run's steps by kind (decode, verify): how many, their mean wall ms
        and the engine thread's mean ms in each HOST_PARTS part (where a verify step's
        time goes against a plain one's: on a GPU a lockstep verify's graph building is
        not hidden behind the device), the draft chains' mean time (with time_drafts),
        and the speculation policy's measured break-even (accepted drafts a verify must
        average; None: not measured). The run's traced steps are throughput()'s `traced`
        (counted in their kind's wall time, left out of the policy's)."""
        from deltaserve.engine.api import HOST_PARTS, STEP_KINDS

        assert self.engine is not None and self.before is not None, "steps() before a run"
        after, before = self.engine.scheduler.step_times.snapshot(), self.before
        out: dict = {}
        for kind in ("decode", "verify"):
            k = STEP_KINDS.index(kind)
            n = after.counts[k][-1] - before.counts[k][-1]
            if not n:
                continue
            wall = (after.seconds[k] - before.seconds[k]) / n
            parts = [
                (a - b) / n for a, b in zip(after.host_parts[k], before.host_parts[k], strict=True)
            ]
            out[f"{kind}_steps"] = n
            out[f"{kind}_ms"] = round(1e3 * wall, 2)
            out[f"{kind}_host_ms"] = {
                p: round(1e3 * v, 2) for p, v in zip(HOST_PARTS, parts, strict=True)
            }
        if self._drafts_s:
            out["draft_ms"] = round(1e3 * sum(self._drafts_s) / len(self._drafts_s), 2)
        out["chained_steps"] = self._chained
        spec = self.engine.speculation
        out["break_even"] = spec.break_even() if spec is not None else None
        return out

    def _build(self) -> LLMEngine:
        from deltaserve.engine.engine import LLMEngine

        engine = LLMEngine(self.loaded, self.config)
        if self.accept is not None:
            (self._impose if self.imposed else self._force)(engine)
        if self.time_drafts and engine.runner.drafter is not None:
            self._time_drafts(engine)
        chained_plan = engine.scheduler.chained_plan

        def counting() -> StepPlan | None:  # verify steps chained (pipeline_verify)
            plan = chained_plan()
            self._chained += plan is not None
            return plan

        engine.scheduler.chained_plan = counting  # type: ignore[method-assign]
        if self.always and engine.speculation is not None:
            # a break-even of 0: no row ever pauses, so every step verifies
            engine.speculation.break_even = lambda: 0.0  # type: ignore[method-assign]
        step = engine.step

        def recording() -> list[RequestOutput]:
            deltas = step()
            self._counts = {}
            for d in deltas:
                if d.token_ids and d.request_id.isdigit():
                    i = int(d.request_id)
                    self.outputs.setdefault(i, []).extend(d.token_ids)
                    self._counts[i] = len(d.token_ids)
            return deltas

        engine.step = recording  # type: ignore[method-assign]
        return engine

    def _time_drafts(self, engine: LLMEngine) -> None:
        """Each draft chain evaluated on its own, the device synchronised before and
        after: what the head's k forwards (and their vocabulary projections) cost in a
        verify step, against the step's wall time."""
        import time

        import mlx.core as mx

        drafter = engine.runner.drafter
        draft = drafter.draft

        def timed(*args: object) -> DraftRound:
            mx.synchronize()
            start = time.perf_counter()
            out = draft(*args)
            mx.eval([a for a in (out.tokens, out.logits) if a is not None])
            mx.synchronize()
            self._drafts_s.append(time.perf_counter() - start)
            return out

        drafter.draft = timed  # type: ignore[method-assign]

    def _force(self, engine: LLMEngine) -> None:
        """The drafter proposes oracle tokens, each kept with probability `accept`."""
        import mlx.core as mx

        from deltaserve.engine.speculative import DraftRound

        drafter = engine.runner.drafter
        if drafter is None or self.oracle is None:
            raise SystemExit("forced drafts need an MTP head and the plain run's outputs")
        draft, k, vocab = drafter.draft, drafter.num_draft, self.loaded.config.vocab_size
        rng, accept, runs = random.Random(self.seed), self.accept, self.oracle
        width = max(len(t) for run in runs for t in run.values()) + 2 * (k + 1)
        # each request's oracle tokens as an array, past max_tokens its last + 1
        tables: dict[tuple[int, int], mx.array] = {}

        def table(run: int, i: int) -> mx.array:
            if (run, i) not in tables:
                true = runs[run][i]
                fill = [(true[-1] if true else 0) + 1] * (width - len(true))
                tables[run, i] = mx.array(true + fill, dtype=mx.int32)
            return tables[run, i]

        def forced(
            row_ids: list[str], state: BatchState, last: mx.array, sampling: list[SamplingRow]
        ) -> DraftRound:
            head = draft(row_ids, state, last, sampling).tokens  # the head runs as usual
            # the plain engine's outputs of the same run (the warm-up has its own prompts:
            # drafts from the measured run's outputs would teach the policy a 0% rate);
            # throughput() runs its warm-up then its measured run, however often called
            run = (len(self.runs) - 1) % 2
            true = mx.stack([table(run, int(r.split("/")[0])) for r in row_ids])
            runner = engine.runner
            emitted = mx.array([len(runner.rows.output_ids[r]) for r in row_ids])
            before = runner.chain_source  # a chained verify's: what the one before keeps
            if before is not None:
                emitted = emitted + before.num_accepted + 1
            true = mx.take_along_axis(true, emitted[:, None] + mx.arange(k)[None], axis=1)
            keep = mx.array([[rng.random() < accept for _ in range(k)] for _ in row_ids])
            drafts = mx.where(keep, true, (true + 1) % vocab).astype(mx.int32)
            # the head's drafts stay in the graph (always >= 0), so their cost is paid; the
            # forced drafts are certain (q one-hot on each): greedy rows accept by argmax
            return DraftRound(mx.where(head >= 0, drafts, head), None)

        drafter.draft = forced  # type: ignore[method-assign]

    def _impose(self, engine: LLMEngine) -> None:
        """Each verify's drafts, once its logits are computed, become the target's argmax
        where kept (probability `accept` each) and a wrong token where not, so the
        acceptance rule keeps each row's leading run of kept drafts (module docstring)."""
        import mlx.core as mx

        drafter = engine.runner.drafter
        if drafter is None:
            raise SystemExit("imposed acceptance needs an MTP head")
        accept, vocab = drafter.accept, self.loaded.config.vocab_size
        rng, share = random.Random(self.seed), self.accept

        def imposed(step: VerifyStep, rows: list[SamplingRow]) -> Verdicts:
            b, k = step.drafts.shape
            best = mx.argmax(step.logits[:, :k], axis=-1).astype(mx.int32)
            keep = mx.array([[rng.random() < share for _ in range(k)] for _ in range(b)])
            drafts = mx.where(keep, best, (best + 1) % vocab).astype(mx.int32)
            return accept(dataclasses.replace(step, drafts=drafts), rows)

        drafter.accept = imposed  # type: ignore[method-assign]

    def run(self, prompts: list[list[int]], gens: list[int], on_token: OnToken) -> None:
        def each_token(i: int, now: float) -> None:
            for _ in range(self._counts.get(i, 1)):
                on_token(i, now)

        super().run(prompts, gens, each_token)


def _label(accept: str, random_weights: bool, imposed: bool = False) -> str:
    if accept == "real":
        return "mtp head" + (" (random weights: ~0% acceptance)" if random_weights else "")
    return f"{'imposed' if imposed else 'forced'} {round(100 * float(accept))}%"


def compare(
    loaded: LoadedModel,
    config: EngineConfig,
    batch: int,
    args: argparse.Namespace,
    random_weights: bool,
) -> list[dict]:
    """Plain, then each --accept mode, at one batch size: JSON rows with ratios."""
    # the warm-up runs as long as the measured run, so that every shape it meets (each
    # KV capacity of the model's and the head's stores, each verify and draft width) is
    # traced before it (H100, a fresh machine, a 24-token warm-up: the first mode's 128
    # tokens at B=1 took 20 s of traces, the third mode's 0.8 s)
    shape = (batch, args.gen, args.gen, args.prompt, args.prompt, args.gen)
    plain = Engine("plain", loaded, config)
    base = _steady(plain, shape)
    base["mode"] = "no speculation"
    rows = [base]
    spec = dataclasses.replace(config, speculative="mtp", num_speculative_tokens=args.k)
    for accept in args.accept:
        forced = None if accept == "real" else float(accept)
        imposed = forced is not None and args.imposed
        impl = Engine(
            "mtp", loaded, spec, forced, plain.runs, args.seed + batch, args.always,
            args.time_drafts, imposed,
        )  # fmt: skip
        row = _steady(impl, shape)
        stats = impl.engine.speculation.stats if impl.engine.speculation else None
        drafted = stats.num_drafted if stats else 0
        accepted = stats.num_accepted if stats else 0
        row.update(
            mode=_label(accept, random_weights, imposed),
            k=args.k,
            drafted=drafted,
            accepted=accepted,
            acceptance=accepted / drafted if drafted else float("nan"),
            same_output=None if imposed else impl.outputs == plain.outputs,
            **{
                f"ratio_{key}": row[key] / base[key]
                for key in ("decode_tok_s", "tok_s", "ttft_p50_s")
            },
        )
        rows.append(row)
    return rows


def _steady(impl: Engine, shape: tuple) -> dict:
    """bench.engine_throughput's `steady` on the same prompts each time (the forced drafts
    are the plain run's outputs for them), with the last run's steps (Engine.steps)."""
    return steady(impl, shape, shift=False) | impl.steps()


def table(rows: list[dict]) -> str:
    """A markdown table of compare's rows."""
    out = [
        "| B | mode | decode tok/s | ratio | tok/s | ratio | TTFT p50 s | ratio "
        "| accepted / drafted | acceptance | same output |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spec = "ratio_tok_s" in r
        ratios = [f"{r[key]:.2f}x" if spec else "" for key in RATIOS]
        counts = (
            f"{r['accepted']} / {r['drafted']} | {r['acceptance']:.0%} | {_same(r['same_output'])}"
            if spec
            else " |  | "
        )
        out.append(
            f"| {r['batch']} | {r['mode']} | {r['decode_tok_s']:.1f} | {ratios[0]} | "
            f"{r['tok_s']:.1f} | {ratios[1]} | {r['ttft_p50_s']:.3f} | {ratios[2]} | {counts} |"
        )
    return "\n".join(out)


def _same(same: bool | None) -> str:
    """The same-output column: n/a where the acceptance was imposed (speed only)."""
    return "n/a" if same is None else "yes" if same else "NO"


def steps_table(rows: list[dict]) -> str:
    """A markdown table of each row's steps by kind: count, mean wall ms, and the host's
    mean ms building and submitting the forward, sampling and applying the tokens; the
    verify steps chained onto the one computing (pipeline_verify); the run's steps that
    traced a shape (any kind), the runs it took (`steady`) and the break-even on each
    line."""
    out = [
        "| B | mode | kind | steps | wall ms | build | submit | sample | update | draft ms "
        "| chained | traced | runs | break-even |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for kind in ("decode", "verify"):
            if f"{kind}_steps" not in r:
                continue
            host = r[f"{kind}_host_ms"]
            even = r.get("break_even")
            draft = r.get("draft_ms") if kind == "verify" else None
            chained = r.get("chained_steps", 0) if kind == "verify" else ""
            out.append(
                f"| {r['batch']} | {r['mode']} | {kind} | {r[f'{kind}_steps']} | "
                f"{r[f'{kind}_ms']:.2f} | {host['build']:.2f} | {host['submit']:.2f} | "
                f"{host['sample']:.2f} | {host['update']:.2f} | "
                f"{'' if draft is None else f'{draft:.2f}'} | {chained} | {r['traced']} | "
                f"{r['runs']} | {'' if even is None else f'{even:.2f}'} |"
            )
    return "\n".join(out)


def main() -> None:
    ensure_openblas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", default="small", help="a test shape or a checkpoint path")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--k", type=int, default=2, help="drafts per speculating row and step")
    ap.add_argument(
        "--accept", nargs="+", default=["real", "0.8", "0.6"],
        help="'real' (the MTP head's own drafts) or a forced per-token acceptance in (0, 1]",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the forced drafts' corruption")
    ap.add_argument(
        "--dtype",
        choices=["checkpoint", "float32"],
        default="checkpoint",
        help="float32: the exact comparison on a GPU, where bf16's rounding differs between "
        "a verify's shape and a decode step's and random weights' near ties flip tokens "
        "(then a forced draft, the plain run's continuation, stops matching after a flip)",
    )
    ap.add_argument(
        "--always",
        action="store_true",
        help="rows draft in every step (the policy's pauses off): what a verify step costs "
        "against a plain one, whatever its drafts earn (the steps table)",
    )
    ap.add_argument(
        "--time-drafts",
        action="store_true",
        help="synchronise around each verify step's draft chain and report its mean time "
        "(draft ms): the head's share of a verify step (the chain no longer overlaps)",
    )
    ap.add_argument(
        "--no-submit-first",
        action="store_true",
        help="submit_decode_first off, in both engines: a verify step queues its draft chain "
        "together with the verify forward, not before building it (and a mixed step its decode "
        "forward with the prompts'): the A/B of that switch",
    )
    ap.add_argument(
        "--no-pipeline-verify",
        action="store_true",
        help="pipeline_verify off, in both engines: every verify step runs in lockstep (its "
        "acceptance read back before the next step is planned), not chained onto the one "
        "computing: the A/B of that switch",
    )
    ap.add_argument(
        "--imposed",
        action="store_true",
        help="impose the --accept share on each verify's drafts after its forward instead "
        "of forcing the plain run's continuation: speed only, in any dtype (bf16 included; "
        "module docstring)",
    )
    ap.add_argument("--budget", type=int, default=1024, help="per-step token budget")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    args = ap.parse_args()
    for accept in args.accept:
        if accept != "real" and not 0.0 < float(accept) <= 1.0:
            ap.error(f"--accept {accept}: 'real' or a share in (0, 1]")
    from deltaserve.models.testing import cached_checkpoint

    random_weights = "/" not in args.checkpoint
    path = str(cached_checkpoint(args.checkpoint)) if random_weights else args.checkpoint
    print(json.dumps({"blas": blas_summary(), "checkpoint": args.checkpoint}), flush=True)
    # loads the model once, for every engine. No prefix cache: _steady repeats a mode's
    # throughput() on the same prompts (the forced drafts are the plain run's outputs for
    # them), and a repeat that resumed them from the cache would prefill less than the
    # first run did
    ours = Ours(
        path, args.budget, args.chunk, float32=args.dtype == "float32", prefix_cache=False,
        **({"submit_decode_first": False} if args.no_submit_first else {}),
        **({"pipeline_verify": False} if args.no_pipeline_verify else {}),
    )  # fmt: skip
    if ours.loaded.mtp is None:
        raise SystemExit(f"{args.checkpoint} has no MTP head: nothing to speculate with")
    rows = []
    for batch in args.batches:
        for row in compare(ours.loaded, ours.config, batch, args, random_weights):
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(table(rows))
    print()
    print(steps_table(rows))


if __name__ == "__main__":
    main()
