"""A clean exit (issue 30): `deltaserve serve` stopped ten times, SIGINT and SIGTERM in
turn, each time with token streams open, exits 0 every time and never aborts with C++'s
"terminate called without an active exception" (std::terminate, exit 134); and
AsyncEngine.shutdown returns only once the engine's OS thread is gone.

The servers run pipelined with compiled decode (the GPU's defaults): the engine thread
then holds the most thread-local MLX state (compiled graphs), whose destruction at that
thread's exit took the GIL while the interpreter was finalizing (AsyncEngine.shutdown).
Before the fix ~1 stop in 9 aborted this way here, so ten stops catch a regression only
two times in three; the second test catches it every time. Both take ~75 s here."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.stop_check import stop_once
from deltaserve.engine.api import EngineStoppedError
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.testing import cached_checkpoint

NUM_STOPS = 10
NUM_STREAMS = 4
SERVE_FLAGS = ["--pipeline-steps", "--compile-decode", "--batch-prefill"]


def test_ten_stops_with_open_streams_exit_cleanly() -> None:
    """Every stop: streams were generating, exit status 0, no abort line, no traceback."""
    model = str(cached_checkpoint("tiny"))
    results = []
    for i in range(NUM_STOPS):
        signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
        results.append(stop_once(model, signum, NUM_STREAMS, SERVE_FLAGS, startup_timeout_s=180))
    summary = "\n".join(str(r.summary()) for r in results)
    assert all(r.streams_started == NUM_STREAMS for r in results), summary
    unclean = [r for r in results if not r.clean]
    first = unclean[0].stderr[-3000:] if unclean else ""
    assert not unclean, f"{len(unclean)} of {NUM_STOPS} stops unclean:\n{summary}\n{first}"


def test_stops_with_the_engine_in_its_own_process_exit_cleanly() -> None:
    """--engine-process: every stop with streams open exits 0 without an abort line,
    the signal sent to the server alone or, as a terminal's Ctrl-C and a systemd stop
    send it, to its whole process group (the child ignores it; the server stops it)."""
    model = str(cached_checkpoint("tiny"))
    flags = [*SERVE_FLAGS, "--engine-process"]
    stops = [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True),
             (signal.SIGTERM, True)]  # fmt: skip
    results = [
        stop_once(model, signum, NUM_STREAMS, flags, startup_timeout_s=180, group=group)
        for signum, group in stops
    ]
    summary = "\n".join(str(r.summary()) for r in results)
    assert all(r.streams_started == NUM_STREAMS for r in results), summary
    unclean = [r for r in results if not r.clean]
    first = unclean[0].stderr[-3000:] if unclean else ""
    assert not unclean, f"{len(unclean)} of {len(results)} stops unclean:\n{summary}\n{first}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_shutdown_waits_for_the_engine_os_thread() -> None:
    """After shutdown() the engine's OS thread is gone, not only its Python thread."""
    config = EngineConfig(pipeline_steps=True, compile_decode=True)
    engine = AsyncEngine.start(str(cached_checkpoint("tiny")), config, name="tiny")

    async def generate() -> None:
        request = GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=4))
        async for _ in engine.generate(request):
            pass

    asyncio.run(generate())  # the thread has traced and compiled on its own streams
    native_id = engine._thread.native_id
    engine.shutdown()
    assert not os.path.exists(f"/proc/self/task/{native_id}")
    engine.shutdown()  # idempotent


def test_a_device_fault_stops_the_engine_and_a_request_error_does_not() -> None:
    """A step failing with an error of the step's own (ValueError) fails the requests in
    flight, hands MLX's cached freed buffers back, and the engine goes on; one failing
    with the device's own (CUDA's illegal memory access: every later step would fail too)
    ends the loop: /health's is_alive turns false, `on_fault` tells the server (which
    exits 1), new requests get EngineStoppedError (HTTP 503)."""
    engine = AsyncEngine.start(str(cached_checkpoint("tiny")), EngineConfig(), name="tiny")
    faults: list[str] = []
    engine.on_fault = faults.append
    released: list[bool] = []
    engine.engine.release_cached_buffers = lambda: released.append(True)
    step = engine.engine.step
    cuda = "cudaGraphInstantiate(...) failed: an illegal memory access was encountered"
    errors = [ValueError("boom"), RuntimeError(cuda)]

    def failing(publish: Callable[[list], None] | None = None) -> list:
        if errors:
            raise errors.pop(0)
        return step(publish)

    engine.engine.step = failing

    async def finish_reasons(rid: str) -> list[str | None]:
        request = GenerationRequest(rid, (1, 2, 3), SamplingParams(max_tokens=4))
        return [out.finish_reason async for out in engine.generate(request) if out.finished]

    try:
        assert asyncio.run(finish_reasons("a")) == ["error"]
        assert engine.stats().is_alive and not faults  # a step's own error: it goes on
        assert released == [True]  # and MLX's freed buffers went back to the device
        assert asyncio.run(finish_reasons("b")) == ["error"]
        engine._thread.join(10)
        assert faults and "illegal memory access" in faults[0] and engine.fault == faults[0]
        assert not engine.stats().is_alive
        assert released == [True]  # a faulted device takes no call: nothing released
        with pytest.raises(EngineStoppedError, match="the device failed"):
            asyncio.run(finish_reasons("c"))
    finally:
        engine.shutdown()


def test_a_request_cancelled_while_it_is_added_is_aborted_and_the_loop_goes_on() -> None:
    """A client that leaves while its request is being added (its acceptance not yet
    answered): the engine thread neither dies setting a cancelled future's result nor
    runs the request for nobody (generate aborts it), and serves the next request."""
    engine = AsyncEngine.start(str(cached_checkpoint("tiny")), EngineConfig(), name="tiny")
    entered, gate = threading.Event(), threading.Event()
    add_request = engine.engine.add_request

    def held_add(request: GenerationRequest) -> None:
        entered.set()
        gate.wait(10)
        add_request(request)

    engine.engine.add_request = held_add
    endless = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)

    async def run() -> list[int]:
        async def consume() -> None:
            async for _ in engine.generate(GenerationRequest("gone", (5, 6, 7), endless)):
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gate.set()
        engine.engine.add_request = add_request
        deadline = time.monotonic() + 10
        while engine.engine.scheduler.num_running or not engine._thread.is_alive():
            assert time.monotonic() < deadline, "the cancelled request still runs"
            await asyncio.sleep(0.02)
        request = GenerationRequest("next", (1, 2, 3), SamplingParams(max_tokens=3))
        return [t async for d in engine.generate(request) for t in d.token_ids]

    try:
        assert len(asyncio.run(asyncio.wait_for(run(), 30))) == 3
    finally:
        gate.set()
        engine.shutdown()
