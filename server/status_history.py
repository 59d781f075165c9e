"""EngineStats sampled every second over the last minutes, for the status page
(server/status.py), so that it plots throughput from before it was opened. The app's
lifespan runs the sampler; ServerState holds it (server/routes_common.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from deltaserve.engine.api import EngineClient, EngineStats


@dataclass(frozen=True)
class Sample:
    """EngineStats figures at one moment (time: wall clock, time.time())."""

    time: float
    generated_tokens_total: int
    num_running: int
    num_waiting: int


class StatusHistory:
    """EngineStats sampled every `interval_s`, the last `window_s` seconds of them.

    `run` samples in the event loop's thread; `series` reads there too, so no lock.
    """

    def __init__(self, interval_s: float = 1.0, window_s: float = 300.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self._samples: deque[Sample] = deque(maxlen=int(window_s / interval_s) + 1)

    def add(self, stats: EngineStats, now: float) -> None:
        """Keep the figures of `stats`, taken at `now`."""
        self._samples.append(
            Sample(now, stats.generated_tokens_total, stats.num_running, stats.num_waiting)
        )

    async def run(self, engine: EngineClient) -> None:
        """Sample `engine` until cancelled (the app's lifespan starts and ends it)."""
        while True:
            # A dead engine must not end the history; /health reports it.
            with contextlib.suppress(Exception):
                self.add(engine.stats(), time.time())
            await asyncio.sleep(self.interval_s)

    def series(self) -> dict[str, list[float]]:
        """Per sample after the first: its time, the tokens/s generated since the sample
        before, and the running and queued rows."""
        out: dict[str, list[float]] = {"time": [], "tokens_per_s": [], "running": [], "queued": []}
        samples = list(self._samples)
        for before, now in zip(samples, samples[1:], strict=False):
            elapsed = now.time - before.time
            if elapsed <= 0:
                continue
            out["time"].append(now.time)
            tokens = now.generated_tokens_total - before.generated_tokens_total
            out["tokens_per_s"].append(tokens / elapsed)
            out["running"].append(now.num_running)
            out["queued"].append(now.num_waiting)
        return out
