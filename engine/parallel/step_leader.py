"""What LLMEngine needs of rank 0's side of a tensor-parallel group.

engine/parallel/tensor_parallel.py's `Leader` has this shape, and that module builds engines; the
engine knows the leader only through this Protocol, so the import goes one way
(tensor_parallel -> engine).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from deltaserve.engine.plan import StepPlan


class StepGuard(Protocol):
    """Ends the group when a wait on the other ranks outlasts its limit (a Watchdog)."""

    def guard(self, what: str) -> AbstractContextManager[None]: ...


class StepLeader(Protocol):
    """Sends each step's plan to the other ranks before the step runs (LLMEngine.step),
    heartbeats while idle, ends the group when a step fails, and stops at shutdown."""

    @property
    def watchdog(self) -> StepGuard: ...

    def publish(self, plan: StepPlan) -> None: ...

    def heartbeat(self) -> None: ...

    def fail(self, error: str) -> None: ...

    def stop(self) -> None: ...
