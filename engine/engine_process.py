"""EngineProcess: the engine loop in a process of its own, the server's EngineClient.

On a GPU an engine step is the engine thread's host time (Python building the step's
graph, MLX submitting it: bench/README.md), and in the server's process that thread
shares one GIL with the event loop: parsing requests, rendering chat templates and
tokenizing (the tokenizer's encode holds the GIL throughout), and every streamed token's
text, JSON and write. Whenever the event loop holds the GIL as the engine thread wants it
back, every stream waits (bench/README.md: the slow steps' building on an H100). In a
process of its own the engine thread shares its GIL with nothing but the pipe.

The child runs AsyncEngine in its deliver mode: one message a step with every delta;
the parent's reader thread hands them to the requests' asyncio queues, one
call_soon_threadsafe per event loop per message, as AsyncEngine does in one process.
multiprocessing carries it: the spawn start method (a fork would copy the server's
threads' held locks into the child) and its Connection (pickled messages over a pipe),
so there is no framing of our own. Tensor parallelism keeps the engine in the server's
process (rank 0 is the group's member, joined by mlx.launch).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import operator
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from deltaserve.engine.api import EngineInfo, EngineStats, EngineStoppedError, EngineSummary
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.streaming import Stream, StreamingClient, deliver, route_deltas
from deltaserve.engine.types import GenerationRequest, RequestOutput

if TYPE_CHECKING:  # the child imports it (_serve): the server's process never loads MLX
    from deltaserve.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

# a RequestOutput's fields in declaration order, as one tuple (RequestOutput(*it) is it)
_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestOutput)))
STATS_EVERY_S = 0.2  # how stale the parent's /metrics snapshot may get while steps run
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the server's (cli.py)


@dataclass(frozen=True)
class _Ready:
    """What the child sends once its engine is loaded: the start-time facts the server
    reads without a round trip (EngineClient's attributes, the start-up summary)."""

    info: EngineInfo
    summary: EngineSummary
    max_context: int
    eos_token_ids: tuple[int, ...]
    model_path: Path
    stats: EngineStats


class EngineProcess(StreamingClient):
    """EngineClient over an AsyncEngine running in a child process."""

    def __init__(
        self, process: multiprocessing.process.BaseProcess, conn: Connection, ready: _Ready
    ) -> None:
        self._process = process
        self._conn = conn
        self.info = ready.info
        self.max_context = ready.max_context
        self.eos_token_ids = ready.eos_token_ids
        self.model_path = ready.model_path
        self._summary = ready.summary
        self._stats = ready.stats
        self._lock = threading.Lock()  # the pipe's send side, and `_closed`
        self._closed = False  # the child takes no more commands
        self._adds: dict[str, Future] = {}  # request id -> its acceptance, until answered
        self._streams: dict[str, Stream] = {}
        self._open: dict[str, int] = {}  # request id -> choices not finished yet
        self._stopping = False
        self._joined = False
        # The device's failure that ended the child's loop, or the child's own end;
        # the server sets on_fault before serving (deltaserve.server.cli)
        self.fault: str | None = None
        self.on_fault: Callable[[str], None] | None = None
        # daemon: a server that never called shutdown() must not wait for it at exit
        self._reader = threading.Thread(
            target=self._read, name="deltaserve-engine-pipe", daemon=True
        )
        self._reader.start()
        # the child ignores SIGTERM, which multiprocessing's own exit handler sends its
        # daemonic children before joining them: a server leaving without shutdown()
        # would wait forever; this handler (registered later, so run first) kills it
        atexit.register(self._kill)

    @classmethod
    def start(cls, model: str, config: EngineConfig, name: str | None = None) -> EngineProcess:
        """Start the child, load `model` there and wait until it is ready; an error the
        loading raised is raised here."""
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        level = logging.getLogger().level
        process = context.Process(
            target=_serve,
            args=(child, model, config, name or model, level),
            name="deltaserve-engine",
            daemon=True,  # a server that dies without shutdown() takes it along
        )
        process.start()
        child.close()
        try:
            kind, payload = parent.recv()
        except EOFError:
            process.join()
            raise RuntimeError(
                f"the engine process exited while loading (exit code {process.exitcode})"
            ) from None
        except BaseException:  # a Ctrl-C while it loads: the child ignores signals
            process.kill()
            process.join()
            raise
        if kind == "failed":
            process.join()
            raise payload
        return cls(process, parent, payload)

    # -- asyncio side ---------------------------------------------------------------------
    def _submit(self, request: GenerationRequest, stream: Stream) -> Future:
        accepted: Future = Future()
        rid = request.request_id
        with self._lock:
            if self._closed or not self._send(("add", request)):
                raise EngineStoppedError(self._refusal())
            self._adds[rid], self._streams[rid], self._open[rid] = accepted, stream, request.n
        return accepted

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._open.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def summary(self) -> EngineSummary:
        return self._summary

    def stats(self) -> EngineStats:
        """The child's latest snapshot (at most STATS_EVERY_S old while it steps)."""
        alive = self._process.is_alive() and not self._stopping and self.fault is None
        return dataclasses.replace(self._stats, is_alive=alive)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the child's loop (it joins its engine thread,
        AsyncEngine.shutdown), and wait for the child to exit; one that does not is
        terminated. Idempotent."""
        if self._joined:
            return
        self._stopping = True
        self._command(("shutdown", timeout))
        self._reader.join(timeout + 5)
        self._process.join(timeout + 5)
        if self._process.is_alive():
            log.error("the engine process did not stop within %g s; killing it", timeout)
        self._kill()

    def _kill(self) -> None:
        """End the child now (SIGKILL: it ignores the others) unless it is gone."""
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._joined = True

    def _command(self, command: tuple) -> None:
        with self._lock:
            if not self._closed:
                self._send(command)

    def _send(self, command: tuple) -> bool:
        """Under the lock: whether `command` went; a pipe the child closed (it is gone:
        the reader says so) takes no more."""
        try:
            self._conn.send(command)
        except OSError:
            self._closed = True
            return False
        return True

    # -- the reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        """The child's messages in order until it stops or its pipe closes; then every
        stream still open ends with an error and nothing more is sent."""
        stopped = False
        while not stopped:
            try:
                kind, *payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "deltas":
                self._route([RequestOutput(*fields) for fields in payload[0]])
            elif kind == "stats":
                self._stats = payload[0]
            elif kind == "accepted":
                self._accepted(*payload)
            elif kind == "fault":
                self._fault(payload[0])
            elif kind == "stopped":
                stopped = True
        with self._lock:
            self._closed = True
        if not stopped and not self._stopping and self.fault is None:
            self._process.join(1)
            self._fault(f"the engine process exited (exit code {self._process.exitcode})")
        self._end_open_streams()

    def _route(self, deltas: list[RequestOutput]) -> None:
        with self._lock:
            _, by_loop = route_deltas(deltas, self._streams, self._open)
        for loop, items in by_loop.items():
            # a closed loop (its caller returned after aborting) has nobody to read them
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, items)

    def _accepted(self, request_id: str, error: BaseException | None) -> None:
        with self._lock:
            accepted = self._adds.pop(request_id, None)
        # None: answered already; not running: cancelled by its caller (who aborts it)
        if accepted is None or not accepted.set_running_or_notify_cancel():
            return
        if error is None:
            accepted.set_result(True)
        else:
            accepted.set_exception(error)

    def _fault(self, reason: str) -> None:
        """The child's loop ended on a device failure, or the child itself ended: the
        server stops serving and exits non-zero (AsyncEngine._fault)."""
        log.critical("the engine failed (%s): the server stops", reason)
        self.fault = reason
        if self.on_fault is not None:
            self.on_fault(reason)

    def _end_open_streams(self) -> None:
        """The child is gone: requests it never answered are refused, and each choice
        still streaming ends with an error (after a shutdown none is: the child ended
        them with "abort" first)."""
        error = self._refusal()
        with self._lock:
            adds, self._adds = self._adds, {}
            ends = [
                RequestOutput(rid, index, (), finish_reason="error", error=error)
                for rid, num_open in self._open.items()
                for index in range(num_open)
            ]
        for accepted in adds.values():
            if accepted.set_running_or_notify_cancel():
                accepted.set_exception(EngineStoppedError(error))
        self._route(ends)


# -- the child ------------------------------------------------------------------------------
class _Link:
    """The child's send side: the engine thread (deltas, faults) and the command thread
    (acceptances, stats) share the pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.engine: AsyncEngine | None = None  # set once loaded
        self._lock = threading.Lock()
        self._stats_sent: EngineStats | None = None

    def send(self, message: tuple) -> None:
        # the server gone: the command loop sees the pipe closed
        with self._lock, contextlib.suppress(OSError):
            self.conn.send(message)

    def deltas(self, deltas: list[RequestOutput]) -> None:
        """AsyncEngine's deliver: a step's deltas in one message, each as the tuple of its
        fields (pickling 64 dataclasses took ~6x as long as their tuples, on the engine
        thread)."""
        self.send(("deltas", [_FIELDS(d) for d in deltas]))

    def stats(self) -> None:
        """The engine's latest snapshot, when it changed since the last one sent."""
        stats = self.engine.stats() if self.engine is not None else None
        if stats is not None and stats != self._stats_sent:
            self._stats_sent = stats
            self.send(("stats", stats))

    def accepted(self, request_id: str, accepted: Future) -> None:
        self.send(("accepted", request_id, _picklable(accepted.exception())))


def _serve(conn: Connection, model: str, config: EngineConfig, name: str, level: int) -> None:
    """The child's main: load, say ready, then apply the server's commands until it says
    shutdown or goes away; the engine thread is joined before the process exits."""
    # The server's process group gets the terminal's Ctrl-C, and a systemd unit's stop
    # SIGTERM, too: the server stops us (EngineProcess.shutdown, or a kill).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=level, format=LOG_FORMAT)
    from deltaserve.engine.async_engine import AsyncEngine

    link = _Link(conn)
    try:
        engine = AsyncEngine.start(model, config, name, deliver=link.deltas)
    except BaseException as exc:
        log.exception("the engine failed to start")
        link.send(("failed", _picklable(exc)))
        return
    link.engine = engine
    engine.on_fault = lambda reason: link.send(("fault", reason))
    # the start-up objects (weights' wrappers, modules, tokenizer tables) out of the
    # collector's way: a full collection over them is a pause of every stream, as the
    # server does for its own (server/heap.py)
    gc.collect()
    gc.freeze()
    ready = _Ready(
        engine.info,
        engine.summary(),
        engine.max_context,
        tuple(engine.eos_token_ids),
        engine.model_path,
        engine.stats(),
    )
    link.send(("ready", ready))
    timeout = 10.0
    try:
        timeout = _commands(conn, engine, link)
    finally:
        engine.shutdown(timeout)
        link.stats()
        link.send(("stopped",))


def _commands(conn: Connection, engine: AsyncEngine, link: _Link) -> float:
    """Apply commands until shutdown (its timeout returned) or the pipe closes."""
    while True:
        if not conn.poll(STATS_EVERY_S):
            link.stats()
            continue
        try:
            kind, *payload = conn.recv()
        except (EOFError, OSError):
            return 10.0
        if kind == "add":
            request: GenerationRequest = payload[0]
            accepted = engine.submit(request)
            accepted.add_done_callback(lambda f, rid=request.request_id: link.accepted(rid, f))
        elif kind == "abort":
            engine.abort(payload[0])
        elif kind == "shutdown":
            return float(payload[0])
        link.stats()


def _picklable(error: BaseException | None) -> BaseException | None:
    """`error` as it can cross the pipe: itself, or a RuntimeError with its text."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
