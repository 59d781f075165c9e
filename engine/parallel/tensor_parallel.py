"""Tensor-parallel serving: rank 0 plans each step, every rank runs it on its slice.

Every process of an mx.distributed group holds 1/N of the weights and of the row state
(models/parallel.py). Rank 0 owns the scheduler, the sampler and the HTTP server; before
each step it sends the step's StepPlan (self-contained: a row's prompt and images come in
the plan that first names it) to every rank through mx.distributed collectives
(`Channel`). Every rank then runs the same ModelRunner.execute on its own states: the
forward's all-reduces and the LM head's all-gather keep them in lockstep, and the
all-gathered logits are whole on every rank. Only rank 0 samples (followers never read
their logits back), so sampling is exactly the one-process sampler; steps are not
pipelined (LLMEngine turns pipeline_steps off), so every decode input is a known id in
the plan and no sampled token has to travel.

Collectives must be issued in the same order on every rank: the followers build the
same graph from the same plan, and evaluate it before waiting for the next plan.

Faults: a rank that dies breaks its sockets, and the others' next collective raises; a
rank that stops answering is caught by `Watchdog`, which ends the process when any wait
on the others outlasts the timeout. Rank 0 sends a heartbeat plan while idle, so an idle
follower can tell a quiet leader from a dead one (a broken ring may also hand back
zeros instead of raising: an empty message counts as a lost rank). A step that raises on
rank 0 ends the group too: the others may be inside it. Every rank then exits with a
clear message (status EXIT_LOST) instead of hanging.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.errors import SetupMismatchError
from deltaserve.engine.plan import StepPlan
from deltaserve.kernels.platform import prepare_device
from deltaserve.models.build import load_model
from deltaserve.models.hub import resolve_checkpoint
from deltaserve.models.parallel import TensorParallel

log = logging.getLogger(__name__)

EXIT_LOST = 3  # a process that lost its group exits with this status
HEARTBEAT_S = 1.0  # an idle rank 0 tells the others it is alive this often
STOP_S = 5.0  # how long shutdown waits for the others to take the stop
STARTUP_S = 300.0  # the first plan may take this long (rank 0 finishing its start-up)
HEADER_WORDS = 4096  # int32 words of a plan's first collective (16 KiB: most plans)


HEARTBEAT = StepPlan()  # rank 0 is alive (it runs nothing)
STOP = None  # rank 0 is shutting down


def join_group(backend: str = "any") -> TensorParallel | None:
    """This process's tensor-parallel group when started by `mlx.launch` (or with the
    backend's environment) on several processes; None when it runs alone."""
    group = mx.distributed.init(strict=False, backend=backend)
    return TensorParallel(group) if group.size() > 1 else None


def exit_lost(message: str, delay_s: float = 0.0) -> None:
    """End this process: the group cannot go on without the lost rank. delay_s lets
    other threads deliver what they hold (the error events of failed requests)."""
    log.critical("tensor parallel: %s; exiting", message)
    print(f"deltaserve: error: tensor parallel: {message}", file=sys.stderr, flush=True)
    time.sleep(delay_s)
    os._exit(EXIT_LOST)


class Watchdog:
    """Calls `on_expire` (default: exit_lost) when a guarded wait outlasts timeout_s.

    mx.eval releases the GIL while it waits, so this thread runs during a blocked
    collective."""

    def __init__(self, timeout_s: float, on_expire: Callable[[str], None] = exit_lost) -> None:
        self.timeout_s = timeout_s
        self._on_expire = on_expire
        self._lock = threading.Lock()
        self._deadline: tuple[float, str, float] | None = None  # (when, what, limit)
        self._thread = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str, timeout_s: float | None = None) -> Iterator[None]:
        """Time out `what` (a wait on the other ranks) after timeout_s (default: the
        watchdog's). Guards nest: the inner one's limit holds while it is open."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            outer, self._deadline = self._deadline, (time.monotonic() + limit, what, limit)
        try:
            yield
        finally:
            with self._lock:
                self._deadline = outer  # a guard inside another hands the outer one back

    def _watch(self) -> None:
        tick = min(0.1, self.timeout_s / 10)
        while True:
            time.sleep(tick)
            with self._lock:
                deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline[0]:
                self._deadline = None
                self._on_expire(f"no answer from the other ranks within {deadline[2]:g} s "
                                f"while waiting for {deadline[1]}")  # fmt: skip


class Channel:
    """Python objects from rank 0 to every rank, pickled, through all_sum (the other
    ranks add zeros). Ranks of one deployment trust each other, as they share weights."""

    def __init__(self, parallel: TensorParallel) -> None:
        self.parallel = parallel

    def send(self, obj: object) -> None:
        """Rank 0: deliver obj to every other rank's `receive`."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        words = np.frombuffer(payload + b"\0" * (-len(payload) % 4), dtype=np.int32)
        head = np.zeros(HEADER_WORDS, np.int32)
        head[0] = len(payload)
        first = words[: HEADER_WORDS - 1]
        head[1 : 1 + len(first)] = first
        self._sum(head)
        if len(words) > HEADER_WORDS - 1:
            self._sum(words[HEADER_WORDS - 1 :])

    def receive(self) -> object:
        """Ranks > 0: the next object rank 0 sent."""
        head = self._sum(np.zeros(HEADER_WORDS, np.int32))
        size = int(head[0])
        if size <= 0:  # a broken ring can hand back zeros instead of raising
            raise RuntimeError("an empty message from rank 0 (its connection is gone)")
        words = head[1:]
        rest = -(-size // 4) - (HEADER_WORDS - 1)
        if rest > 0:
            words = np.concatenate([words, self._sum(np.zeros(rest, np.int32))])
        try:
            return pickle.loads(words.tobytes()[:size])
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise RuntimeError(f"a garbled message from rank 0 ({exc})") from exc

    def _sum(self, words: np.ndarray) -> np.ndarray:
        return np.array(self.parallel.all_sum(mx.array(words)), dtype=np.int32)


def setup_parts(model: str, config: EngineConfig) -> list[bytes]:
    """What every rank must agree on: the checkpoint's config, its weight files (names
    and sizes) and the engine config."""
    path = resolve_checkpoint(model)
    files = sorted(f"{f.name}:{f.stat().st_size}" for f in path.glob("*.safetensors"))
    return [(path / "config.json").read_bytes(), "\n".join(files).encode(), repr(config).encode()]


def check_same_setup(parallel: TensorParallel, parts: Sequence[bytes]) -> None:
    """Raise on every rank unless all ranks start from the same `parts` (checkpoint
    config, weight files, engine config): a mismatch would compute garbage, not fail."""
    digest = hashlib.sha256(b"\0".join(parts)).digest()
    mine = mx.array(np.frombuffer(digest, dtype=np.int32))
    every = np.array(mx.distributed.all_gather(mine[None], group=parallel.group))
    differ = [r for r in range(parallel.size) if not np.array_equal(every[r], every[0])]
    if differ:
        raise SetupMismatchError(
            f"ranks {differ} do not load the same checkpoint and engine config as rank 0"
        )


class Leader:
    """Rank 0's side (the engine's StepLeader, engine/parallel/step_leader.py): sends each step's
    plan before the step runs (LLMEngine.step), a heartbeat while idle, and stop at
    shutdown; a failed step ends the group (`fail`)."""

    def __init__(
        self, channel: Channel, watchdog: Watchdog, on_lost: Callable[[str], None] | None = None
    ) -> None:
        """on_lost: what a lost rank or a failed step does (default: exit_lost, after a
        short delay so the requests that failed get their error events out)."""
        self.channel = channel
        self.watchdog = watchdog
        self._on_lost = on_lost or (lambda message: exit_lost(message, delay_s=0.5))
        self._last_sent = time.monotonic()

    def publish(self, plan: StepPlan) -> None:
        """Send the step `plan` to every rank."""
        self._send(plan)

    def heartbeat(self) -> None:
        """While idle: tell the others rank 0 is alive (every HEARTBEAT_S)."""
        if time.monotonic() - self._last_sent >= HEARTBEAT_S:
            self._send(HEARTBEAT)

    def fail(self, error: str) -> None:
        """A step raised on rank 0: the others may be inside that step's collectives, and
        no rank can tell which state changes the rest applied. The group ends (after a
        second, so the failed requests' error events go out first); a supervisor
        restarts it."""
        message = f"a step failed on rank 0 ({error}); the ranks' states may disagree"
        threading.Timer(1.0, self._on_lost, args=(message,)).start()

    def stop(self) -> None:
        """Shutdown: the others return from `follow` (those already gone are not waited
        for: a launcher stops every rank at once)."""
        try:
            with self.watchdog.guard("every rank to take the stop", STOP_S):
                self.channel.send(STOP)
        except RuntimeError as exc:
            log.info("tensor parallel: not every rank took the stop (%s)", exc)

    def _send(self, plan: StepPlan | None) -> None:
        try:
            with self.watchdog.guard("every rank to take rank 0's next plan"):
                self.channel.send(plan)
        except RuntimeError as exc:  # a lost peer: the group is over
            self._on_lost(f"lost a rank ({exc})")
            raise
        self._last_sent = time.monotonic()


def start_engine(
    model: str,
    config: EngineConfig,
    parallel: TensorParallel | None = None,
    dtype: mx.Dtype | None = None,
) -> LLMEngine:
    """Load `model` (in `dtype`, None: deltaserve.models.build's default) and build its engine. In a
    group, every rank calls this at once: it checks that all start alike, loads this
    rank's slices, and gives rank 0 its Leader."""
    prepare_device(config)  # before MLX's first GPU evaluation: loading the weights
    if parallel is None:
        return LLMEngine(load_model(model, dtype), config)
    check_same_setup(parallel, [*setup_parts(model, config), str(dtype).encode()])
    loaded = load_model(model, dtype, parallel)
    leader = None
    if parallel.rank == 0:
        leader = Leader(Channel(parallel), Watchdog(config.distributed_timeout_s))
    return LLMEngine(loaded, config, leader=leader)


def follow(engine: LLMEngine) -> None:
    """Ranks > 0: run rank 0's plans on this rank's slice until rank 0 stops (returns)
    or is lost (exit_lost)."""
    parallel = engine.loaded.parallel
    assert parallel is not None and parallel.rank > 0, "follow runs on ranks > 0 only"
    channel, watchdog = Channel(parallel), Watchdog(engine.config.distributed_timeout_s)
    try:
        _follow(engine, channel, watchdog)
    except RuntimeError as exc:  # a collective failed: rank 0 (or another rank) is gone
        exit_lost(f"lost a rank ({exc})")


def _follow(engine: LLMEngine, channel: Channel, watchdog: Watchdog) -> None:
    # rank 0 heartbeats once its engine thread runs; until then it may still be loading
    limit = max(STARTUP_S, watchdog.timeout_s)
    while True:
        with watchdog.guard("the next plan from rank 0", limit):
            plan = channel.receive()
        limit = None
        if plan is STOP:
            return
        assert isinstance(plan, StepPlan), f"rank 0 sent a {type(plan).__name__}"
        with watchdog.guard("a step's collectives"):
            # the same graph (and collectives, in the same order) as rank 0's step;
            # evaluated now, so that waiting for the next plan only waits on rank 0
            engine.runner.execute(plan)
            engine.runner.flush_saves()
            mx.synchronize()
