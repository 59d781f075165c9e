"""The packed mixed step (engine/packed_step.py) against the compiled decode step and the
compiled fresh-prompt forward run apart: what each costs the host to build (the calls
until their lazy outputs return), to submit (mx.async_eval), and in all (synchronised
before and after), for a decode batch of `--rows` rows beside one fresh prompt of each
`--sizes` length, and the ratio packed / apart of each.

    python3 -m bench.packed_step --shape 9B --rows 16 64 --sizes 64 256

On a GPU the question is whether one forward that reads each weight once (saving the
prompt's second pass over the weights: ~6 ms at 9B on an H100) costs no more host time
than the two compiled forwards, since a layer-by-layer compiled call is one call per
layer where the decode step is one call in all. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.compiled_prefill import CompiledPrefill
from deltaserve.engine.decode import CompiledDecode
from deltaserve.engine.packed_step import PackedMixedStep
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint

HISTORY = 100  # tokens each decode row holds (its KV's first capacity)


def _decoding(loaded: LoadedModel, rows: int) -> BatchState:
    """`rows` rows that hold HISTORY tokens each, evaluated."""
    state = BatchState.empty(loaded.config)
    tokens = mx.full((1, HISTORY), 100, mx.int32)
    loaded.model([ForwardGroup(tokens, text_positions([0], HISTORY), state.layers)])
    for _ in range(rows - 1):
        state.merge(state.extract(0))
    mx.eval(*state.state_arrays())
    return state


def _timed(step: Callable[[int], list[mx.array]], reps: int) -> dict[str, float]:
    """Median build / submit / total ms of `step(i)` (it returns what to evaluate), after
    two untimed calls that trace and warm its shapes."""
    build, submit, total = [], [], []
    for i in range(reps + 2):
        mx.synchronize()
        start = time.perf_counter()
        out = step(i)
        built = time.perf_counter()
        mx.async_eval(*out)
        submitted = time.perf_counter()
        mx.synchronize()
        if i >= 2:
            build.append(1e3 * (built - start))
            submit.append(1e3 * (submitted - built))
            total.append(1e3 * (time.perf_counter() - start))
    return {
        "build_ms": round(statistics.median(build), 3),
        "submit_ms": round(statistics.median(submit), 3),
        "total_ms": round(statistics.median(total), 3),
    }


def _steps(
    loaded: LoadedModel,
    decode: CompiledDecode,
    prompts: CompiledPrefill,
    packed: PackedMixedStep,
    rows: int,
    size: int,
) -> dict[str, Callable[[int], list[mx.array]]]:
    """The mixed step both ways, each over its own decode rows: step i decodes each row's
    next token and prefills a fresh `size`-token prompt."""
    model, config = loaded.model, loaded.config
    apart_state, packed_state = _decoding(loaded, rows), _decoding(loaded, rows)
    tokens = mx.zeros((rows, 1), mx.int32)

    def apart(i: int) -> list[mx.array]:
        logits = decode(tokens, [HISTORY + i] * rows, apart_state)
        hidden, fresh = prompts([[100 + i] * size], BatchState.empty(config))
        state = [*apart_state.state_arrays(), *fresh[0].state_arrays()]
        return [logits, model.logits(hidden[:, -1]), *state]

    def together(i: int) -> list[mx.array]:
        offsets, prompt = [HISTORY + i] * rows, [[100 + i] * size]
        logits, [(hidden, fresh)] = packed(
            tokens, offsets, packed_state, [prompt], BatchState.empty(config)
        )
        state = [*packed_state.state_arrays(), *fresh[0].state_arrays()]
        return [logits, model.logits(hidden[:, -1]), *state]

    return {"apart": apart, "packed": together}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="0.8B", help="a deltaserve.models.testing name or path")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    path = args.shape if "/" in args.shape else str(cached_checkpoint(args.shape))
    loaded = load_model(path)
    model = loaded.model
    print(json.dumps({"shape": args.shape, "device": str(mx.default_device())}), flush=True)
    forwards = CompiledDecode(model), CompiledPrefill(model), PackedMixedStep(model)
    table = []
    for rows in args.rows:
        for size in args.sizes:
            for name, step in _steps(loaded, *forwards, rows, size).items():
                line = {"rows": rows, "chunk": size, "forward": name, **_timed(step, args.reps)}
                table.append(line)
                print(json.dumps(line), flush=True)
    print("\n| rows | chunk | apart build / submit / total ms | packed | packed / apart total |")
    print("|---|---|---|---|---|")
    for a, p in zip(table[::2], table[1::2], strict=True):
        parts = [
            f"{x['build_ms']:.2f} / {x['submit_ms']:.2f} / {x['total_ms']:.2f}" for x in (a, p)
        ]
        ratio = p["total_ms"] / a["total_ms"]
        print(f"| {a['rows']} | {a['chunk']} | {parts[0]} | {parts[1]} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
