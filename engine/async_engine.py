"""AsyncEngine: one thread owns MLX and steps the engine; asyncio callers stream deltas.

Commands (add, abort) reach the engine thread through a thread-safe inbox and are applied
at a step boundary; each request's deltas come back through its own asyncio.Queue on the
caller's event loop, or, in an engine process of its own (engine/engine_process.py), all
of a step's deltas to one `deliver` callback. A step that raises ends the affected requests
with an error and the loop keeps running.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from deltaserve.engine.api import EngineInfo, EngineStats, EngineStoppedError, EngineSummary
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.errors import is_device_fault
from deltaserve.engine.parallel.tensor_parallel import start_engine
from deltaserve.engine.prefix_cache.index import PrefixCacheStats
from deltaserve.engine.scheduling.speculation import SpeculationStats
from deltaserve.engine.streaming import (
    Stream,
    StreamingClient,
    deliver,
    hand_off,
    route_deltas,
)
from deltaserve.engine.types import GenerationRequest, RequestOutput
from deltaserve.models.parallel import TensorParallel

log = logging.getLogger(__name__)
# With stream_handoff, the longest the engine thread waits for the event loop to write a
# step's tokens: a loop busy elsewhere (a burst of requests parsed) costs a step no more
HANDOFF_WAIT_S = 0.002


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)


def engine_info(engine: LLMEngine) -> EngineInfo:
    """The start-time facts of `engine`, read once before its thread starts."""
    parallel = engine.loaded.parallel
    cache = engine.prefix_cache
    return EngineInfo(
        platform=engine.platform,
        num_ranks=parallel.size if parallel is not None else 1,
        prefix_cache_max_bytes=cache.max_bytes if cache is not None else 0,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_prefill_chunk=engine.config.max_prefill_chunk,
    )


class AsyncEngine(StreamingClient):
    """EngineClient over an LLMEngine running in a background thread."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        model_path: Path,
        deliver: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        """deliver: given, each step's deltas go to it (on the engine thread) instead of
        to asyncio streams, and requests come in by `submit` (an engine process's loop)."""
        self.engine = engine
        self._deliver = deliver
        self.model_name = model_name
        self.model_path = model_path
        self.max_context = engine.max_context
        self.eos_token_ids = engine.loaded.config.eos_token_ids
        self.info = engine_info(engine)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox_lock = threading.Lock()
        self._closed = False  # the loop has ended: `_send` answers adds itself
        self._wakeup = threading.Event()
        self._streams: dict[str, Stream] = {}  # the asyncio streams (no `deliver`)
        self._open: dict[str, int] = {}  # engine-thread count of unfinished choices
        self._counters = _Counters()
        self._stopping = False
        # The device's failure that ended the loop (`_fault`), and who to tell of it: the
        # server sets on_fault before serving (deltaserve.server.cli)
        self.fault: str | None = None
        self.on_fault: Callable[[str], None] | None = None
        self._joined = False  # shutdown() saw the engine's OS thread gone
        self._publish_stats()
        # Joined by shutdown() (see there); daemon only so that a step stuck past its
        # timeout cannot hold the process open forever.
        self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls,
        model: str,
        config: EngineConfig,
        name: str | None = None,
        parallel: TensorParallel | None = None,
        deliver: Callable[[list[RequestOutput]], None] | None = None,
    ) -> AsyncEngine:
        """Load `model` (local dir or hub id) and start the engine thread. `parallel`:
        this is rank 0 of a tensor-parallel group (the others run tensor_parallel.follow)."""
        engine = start_engine(model, config, parallel)
        # The grammar engine's tokenizer (~4 s for 248k tokens) loads in the background
        # now, not in the first constrained request.
        engine.grammar_compiler().warm_up()
        return cls(engine, name or model, engine.loaded.path, deliver)

    # -- asyncio side ---------------------------------------------------------------------
    def _submit(self, request: GenerationRequest, stream: Stream) -> Future:
        accepted: Future = Future()
        self._send(("add", request, stream, accepted))
        return accepted

    def submit(self, request: GenerationRequest) -> Future:
        """With `deliver`: queue `request`; the future says whether it was accepted (or
        raises as generate would), and its deltas go to `deliver`."""
        assert self._deliver is not None, "submit() is the deliver mode's; use generate()"
        accepted: Future = Future()
        self._send(("add", request, None, accepted))
        return accepted

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def summary(self) -> EngineSummary:
        """The engine's set-up in a user's terms; call before serving (it reads the
        engine's state from this thread)."""
        return self.engine.summary()

    def stats(self) -> EngineStats:
        """The latest snapshot the engine thread published (never reads live state)."""
        alive = self._thread.is_alive() and not self._stopping
        return dataclasses.replace(self._stats, is_alive=alive)

    def _publish_stats(self) -> None:
        """Engine thread only: snapshot counters after each step for other threads."""
        eng = self.engine
        cache = eng.prefix_cache.stats if eng.prefix_cache is not None else PrefixCacheStats()
        spec = eng.speculation.stats if eng.speculation is not None else SpeculationStats()
        self._stats = EngineStats(
            is_alive=True,
            num_waiting=len(eng.scheduler.waiting),
            num_running=eng.scheduler.num_running,
            state_bytes_in_use=eng.states.nbytes(),
            state_bytes_budget=eng.budget.total,
            kv_bytes_per_token=eng.budget.costs.kv_bytes_per_token,
            mlx_active_bytes=mx.get_active_memory(),
            mlx_peak_bytes=mx.get_peak_memory(),
            prompt_tokens_total=self._counters.prompt_tokens,
            generated_tokens_total=self._counters.generated_tokens,
            prefix_cache_bytes=cache.nbytes,
            prefix_cache_lookup_tokens_total=cache.lookup_tokens,
            prefix_cache_hit_tokens_total=cache.hit_tokens,
            prefix_cache_evictions_total=cache.evictions,
            speculative_drafted_tokens_total=spec.num_drafted,
            speculative_accepted_tokens_total=spec.num_accepted,
            speculative_break_even_drafts=_break_even(eng),
            step_times=eng.scheduler.step_times.snapshot(),
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the loop, and join the engine thread: the
        Python thread, then the OS thread under it. Idempotent.

        Why both: MLX keeps per-thread state (the mx.compile cache, the thread's streams
        and their command encoders) that C++ destroys at OS-thread exit, after the Python
        thread is over and join() has returned. Destroying a compile-cache entry drops
        the Python function it traced, so it takes the GIL; if the main thread has begun
        finalizing the interpreter by then, Python ends the exiting thread in
        pthread_exit, whose unwinding through that noexcept destructor calls
        std::terminate: "terminate called without an active exception", exit 134 (a
        core dump of a CPU server showed exactly this stack on the exiting engine
        thread). On the CPU the window is a few ms and ~1 stop in 9 aborted (pipelined,
        compiled decode); on the H200 every stop did (likely a wider window: that
        thread's exit also synchronizes and destroys its CUDA command encoder, as
        mlx-cuda 0.32.4's code shows; not traced there). So the process exits only once
        the OS thread is gone: the loop stopped, its MLX work synchronized
        (LLMEngine.close), the Python thread joined, then its thread-local MLX state
        destroyed while the interpreter is still whole."""
        if self._joined:
            return
        self._send(("shutdown",))
        deadline = time.monotonic() + timeout
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %g s", timeout)
            return
        self._joined = _wait_os_thread_exit(self._thread, deadline - time.monotonic())
        if not self._joined:
            log.warning("the engine thread's exit did not finish within %g s", timeout)

    def _send(self, command: tuple) -> None:
        with self._inbox_lock:
            if not self._closed:
                self._inbox.put(command)
                self._wakeup.set()
                return
        if command[0] == "add":  # the loop has ended: nobody would ever answer it
            self._refuse(command[3])

    def _refuse(self, accepted: Future) -> None:
        accepted.set_exception(EngineStoppedError(self._refusal()))

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if self._stopping:
                break
            if not self.engine.has_work():
                self._publish_stats()
                self.engine.idle()
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            try:
                deltas = self.engine.step(publish=self._dispatch)
            except Exception as exc:  # one bad step must not kill the loop
                log.exception("engine step failed")
                deltas = self.engine.fail_all(f"engine error: {exc}")
                if is_device_fault(exc):
                    self._fault(str(exc))
                else:
                    self.engine.release_cached_buffers()
            self._dispatch(deltas)
            self._publish_stats()
        with self._inbox_lock:  # from here `_send` refuses; what came before is answered
            self._closed = True
        self._drain_inbox()
        self._dispatch(self._abort_all())
        if self.fault is None:
            self.engine.close()  # synchronizes: a faulted device would raise again

    def _fault(self, reason: str) -> None:
        """Engine thread: the device failed (errors.is_device_fault); every later step
        would fail too, so the loop ends (the requests in flight already failed), /health
        turns 503, new requests are refused, and `on_fault` tells the server, which exits
        non-zero for its supervisor to restart it."""
        log.critical(
            "the device failed (%s): no later step can run in this process; the engine "
            "stops and the server exits so that its supervisor can restart it",
            reason,
        )
        self.fault = reason
        self._stopping = True
        if self.on_fault is not None:
            self.on_fault(reason)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._dispatch(self.engine.abort(command[1]))
            elif kind == "shutdown":
                self._stopping = True

    def _add(self, request: GenerationRequest, stream: Stream | None, accepted: Future) -> None:
        # a caller cancelled while this waited in the inbox (its generate sends an abort
        # after it) is gone: the request is never queued, and its future cannot be set
        if not accepted.set_running_or_notify_cancel():
            return
        if self._stopping:
            self._refuse(accepted)
            return
        try:
            self.engine.add_request(request)
        except Exception as exc:
            accepted.set_exception(exc)
            return
        if stream is not None:
            self._streams[request.request_id] = stream
        self._open[request.request_id] = request.n
        num_prompt = len(request.prompt_ids)
        log.debug("request %s queued: %d prompt tokens", request.request_id, num_prompt)
        self._counters.prompt_tokens += num_prompt
        accepted.set_result(True)

    def _abort_all(self) -> list[RequestOutput]:
        deltas = []
        for request_id in list(self._open):
            deltas.extend(self.engine.abort(request_id))
        return deltas

    def _dispatch(self, deltas: list[RequestOutput]) -> None:
        """Hand a step's deltas to their streams: one call into each event loop for the
        whole step, not one a delta (or all of them to `deliver`). Each
        call_soon_threadsafe writes to the loop's wake-up socket, a syscall that lets the
        event loop take the GIL, and the engine thread then waits for it back; on a GPU,
        where a step is the engine thread's host time, 64 streams meant 64 hand-overs a
        step."""
        counters = self._counters
        for delta in deltas:
            counters.generated_tokens += len(delta.token_ids)
        known, by_loop = route_deltas(deltas, self._streams, self._open)
        for delta in known:
            if delta.finished:
                reason = delta.finish_reason or "unknown"
                counters.finished[reason] = counters.finished.get(reason, 0) + 1
        if self._deliver is not None:
            if known:
                self._deliver(known)
            return
        if self.engine.platform.stream_handoff and by_loop:
            hand_off(by_loop, HANDOFF_WAIT_S)
            return
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(deliver, items)


def _wait_os_thread_exit(thread: threading.Thread, timeout: float) -> bool:
    """After `thread` joined: wait until its OS thread is gone too (its thread-local
    destructors ran), sleeping so that they can take the GIL. True once gone, or where
    that cannot be seen (no /proc/self/task: not Linux)."""
    task = f"/proc/self/task/{thread.native_id}"
    if thread.native_id is None or not os.path.isdir("/proc/self/task"):
        return True
    deadline = time.monotonic() + max(0.0, timeout)
    while os.path.exists(task):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _break_even(engine: LLMEngine) -> float:
    """Speculation's measured break-even (EngineStats), -1 when there is none."""
    measured = engine.speculation.break_even() if engine.speculation is not None else None
    return -1.0 if measured is None else measured
