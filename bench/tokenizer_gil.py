"""How much a Python thread gets done while the server tokenizes: the GIL's share.

    python -m bench.tokenizer_gil [--words 4000] [--reps 20]

The engine thread shares the server's interpreter, so whatever the HTTP side runs while
holding the GIL (a request's template, its tokenization) is time the engine thread does
not build its next step in. A thread counts in a Python loop while the main thread calls
the Rust tokenizer's `encode`, then `encode_batch` of one text, then sleeps (GIL free):
its count against the same wall time alone is its share (1.0 = untouched; on a 2-core
box a spinner beside a GIL-free wait gets ~0.8). Prints one JSON line per call kind.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path


def _spin(stop: threading.Event, counts: list[int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    counts.append(n)


def _spun(seconds: float | None, work: Callable[[], None] | None, reps: int) -> tuple[int, float]:
    """(spinner count, wall seconds) while `work` runs reps times, or for `seconds` idle."""
    stop, counts = threading.Event(), []
    thread = threading.Thread(target=_spin, args=(stop, counts))
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    if work is None:
        time.sleep(seconds or 0.0)
    else:
        for _ in range(reps):
            work()
    wall = time.perf_counter() - start
    stop.set()
    thread.join()
    return counts[0], wall


def share(work: Callable[[], None], reps: int) -> dict:
    """The spinner's count beside `work` over its count alone for as long."""
    busy, wall = _spun(None, work, reps)
    alone, _ = _spun(wall, None, reps)
    return {"ms_per_call": round(1e3 * wall / reps, 2), "spinner_share": round(busy / alone, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="tiny")
    ap.add_argument("--words", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from deltaserve.models.testing import cached_checkpoint

    path = Path(cached_checkpoint(args.checkpoint)) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    sentence = "The quick brown fox jumps over the lazy dog near the river."
    text = " ".join([sentence] * (args.words // 12))
    kinds = {
        "encode": lambda: tokenizer.encode(text, add_special_tokens=False),
        "encode_batch": lambda: tokenizer.encode_batch([text], add_special_tokens=False),
        "sleep_10ms": lambda: time.sleep(0.01),
    }
    for name, work in kinds.items():
        line = {"call": name, "words": args.words, **share(work, args.reps)}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
