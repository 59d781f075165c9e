"""The server process's garbage collector: start-up objects frozen out of its scans, and
every collection's pause timed.

A full (generation 2) collection walks every tracked object and holds the GIL while it
does, so the engine thread builds no step and no stream is written until it ends: after
`deltaserve serve` has loaded the model, tokenizer and app (~260,000 objects with a tiny
checkpoint), one took 130-170 ms on this workplace's CPU, a stall of every stream's
tokens. The objects made at start-up live as long as the process, so `freeze_startup`
moves them into the permanent generation (gc.freeze, as vLLM does after its start-up);
later full collections walk only what serving allocated since.

`GcPauses` times each collection (gc.callbacks) and keeps a histogram per generation for
GET /metrics (`deltaserve_gc_pause_seconds`); a pause of at least LONG_PAUSE_S is logged,
so a gap in the streams that a collection made says so in the log.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("deltaserve")

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LONG_PAUSE_S = 0.05


def freeze_startup() -> tuple[int, float]:
    """Collect once, then freeze every surviving object out of later collections' scans.
    Returns (objects frozen, seconds the full collection took): the pause a full
    collection would have cost each time it ran over them while serving."""
    started = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - started
    gc.freeze()
    return gc.get_freeze_count(), seconds


class GcPauses:
    """Every collection's duration since `install`, per generation (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # collections run in whichever thread allocates
        self._started: dict[int, float] = {}  # thread id -> start of its collection
        # generation -> (count per bucket (the last: beyond every bound), sum of seconds)
        self.counts = {g: [0] * (len(BUCKETS) + 1) for g in range(3)}
        self.seconds = {g: 0.0 for g in range(3)}

    def install(self) -> None:
        """Start timing collections (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        started = self._started.pop(thread, None)
        if started is not None:
            self.record(info["generation"], now - started)

    def record(self, generation: int, seconds: float) -> None:
        """One collection of `generation` that held the process for `seconds`."""
        bucket = next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))
        with self._lock:
            self.counts[generation][bucket] += 1
            self.seconds[generation] += seconds
        if seconds >= LONG_PAUSE_S:
            logger.info(
                "garbage collection (generation %d) paused the process for %.0f ms",
                generation,
                seconds * 1e3,
            )

    def snapshot(self) -> dict[int, tuple[list[int], float]]:
        """generation -> (count per bucket, sum of seconds), a consistent copy."""
        with self._lock:
            return {g: (list(c), self.seconds[g]) for g, c in self.counts.items()}


PAUSES = GcPauses()  # the process's; `deltaserve serve` installs it


class GcPauseCollector(Collector):
    """`deltaserve_gc_pause_seconds{generation}`, read from a GcPauses at scrape time."""

    def __init__(self, pauses: GcPauses = PAUSES) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "deltaserve_gc_pause_seconds",
            "Python garbage collections, each a pause of every stream (start-up objects "
            "are frozen out of them)",
            labels=["generation"],
        )
        for generation, (counts, total) in self._pauses.snapshot().items():
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([str(generation)], buckets, total)
        yield family
