"""The row table: every row that holds state, and the one hook that releases it.

A row's pieces live in several places: its budget share (and the left padding it may
add) here on the engine thread, its grammar matcher (engine/structured/matchers.py),
and on every worker its batch slot, vision features and prompt (engine/runner.py).
`release` is the only way a row goes, whether it finished, was aborted or the engine
failed: it gives back the budget, runs the release hooks (the matcher), and queues the
row's id for the next plan's freed_row_ids, which drops the worker's pieces. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from deltaserve.engine.cache.budget import MemoryBudget
from deltaserve.engine.request import Request

ReleaseHook = Callable[[Iterable[str]], None]  # called with the released row ids


class RowTable:
    """Rows by id (a Request each), owned by the scheduler."""

    def __init__(self, budget: MemoryBudget, on_release: Sequence[ReleaseHook] = ()) -> None:
        """on_release: what else holds a piece of a row (called with its id on release)."""
        self.budget = budget
        self.rows: dict[str, Request] = {}
        self._on_release = tuple(on_release)
        self._freed: list[str] = []  # released since the last plan

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, joining: Sequence[Request], extra_bytes: int = 0) -> None:
        """Give `joining` (a request's choices) their rows and budget shares; `extra_bytes`
        go to the first (what its row holds only while its prompt is prefilled:
        Admission.prefill_bytes)."""
        for req in joining:
            req.reserved_bytes = self.budget.row_bytes(req.max_total_tokens(), req.speculative)
            self.budget.reserve(req.reserved_bytes)
            self.rows[req.row_id] = req
        joining[0].reserved_bytes += extra_bytes
        self.budget.reserve(extra_bytes)
        self.budget.padding = self.budget.padding_bytes(self.lengths())

    def release(self, req: Request) -> None:
        """A choice ends: its hooks run (a choice that never got a row has nothing else),
        and a row gives its budget share back and is freed on every worker next plan."""
        for hook in self._on_release:
            hook((req.row_id,))
        if self.rows.pop(req.row_id, None) is None:
            return
        self.budget.release(req.reserved_bytes)
        req.reserved_bytes = 0
        self.budget.padding = self.budget.padding_bytes(self.lengths())
        self._freed.append(req.row_id)

    def has_freed(self) -> bool:
        """Whether released rows wait for a plan to free them on the workers."""
        return bool(self._freed)

    def take_freed(self) -> tuple[str, ...]:
        """Rows released since the last call (for the next plan's freed_row_ids)."""
        freed, self._freed = tuple(self._freed), []
        return freed

    def lengths(self, *joining: Request) -> list[int]:
        """Worst-case tokens of every row (and `joining`): what padding costs."""
        return [r.max_total_tokens() for r in (*self.rows.values(), *joining)]

    def forget_workers(self) -> None:
        """The workers dropped every row at once (a failed step): nothing to free there,
        and the budget starts over (its accounting may be broken; this must not raise)."""
        self._freed = []
        self.budget.clear()
