"""The server process's garbage collector (server/heap.py): start-up objects frozen out of
its scans, each collection's pause timed, logged when long and exported to /metrics."""

from __future__ import annotations

import gc
import logging
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from deltaserve.server import heap


def test_freeze_moves_every_survivor_out_of_later_scans() -> None:
    """Objects alive at the freeze are in the permanent generation: a full collection
    afterwards does not see them (gc.get_objects lists only tracked, unfrozen ones)."""
    survivors = [[i] for i in range(20_000)]
    try:
        frozen, seconds = heap.freeze_startup()
        assert frozen >= len(survivors) and seconds >= 0
        unfrozen = {id(o) for o in gc.get_objects()}
        assert not any(id(s) in unfrozen for s in survivors)
        later = [[i] for i in range(100)]
        unfrozen = {id(o) for o in gc.get_objects()}
        assert all(id(o) in unfrozen for o in later)
    finally:
        gc.unfreeze()


def test_pauses_are_timed_per_generation_and_exported() -> None:
    """Installed, a collection of each generation is counted with its duration; the
    histogram buckets are cumulative and a long pause is logged."""
    pauses = heap.GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback
    try:
        assert gc.callbacks.count(pauses._callback) == 1
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    gc.collect(2)  # after uninstall: not counted
    snap = pauses.snapshot()
    assert sum(snap[0][0]) >= 1 and sum(snap[2][0]) == 1 and snap[2][1] > 0
    registry = CollectorRegistry()
    registry.register(heap.GcPauseCollector(pauses))
    text = generate_latest(registry).decode()
    count = re.search(r'deltaserve_gc_pause_seconds_count\{generation="2"\} (\S+)', text)
    inf = re.search(r'deltaserve_gc_pause_seconds_bucket\{generation="2",le="\+Inf"\} (\S+)', text)
    assert count and inf and float(count[1]) == float(inf[1]) == 1.0


def test_a_long_pause_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    pauses = heap.GcPauses()
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        pauses.record(1, 0.001)
        pauses.record(2, 0.2)
    assert [r.getMessage() for r in caplog.records] == [
        "garbage collection (generation 2) paused the process for 200 ms"
    ]
    counts, total = pauses.snapshot()[2]
    assert counts[heap.BUCKETS.index(0.25)] == 1 and total == pytest.approx(0.2)
