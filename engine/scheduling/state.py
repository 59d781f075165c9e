"""The scheduler's state: its queues, its rows, and what the next plan carries.

One object, read and written by the scheduler and its policies (admission, chunking,
run-ahead, stall bound: engine/scheduling/prefill_policy.py), nothing else. Pure Python.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deltaserve.engine.plan import NewRow
from deltaserve.engine.prefix_cache.index import CacheSave
from deltaserve.engine.request import Request
from deltaserve.engine.rows import RowTable
from deltaserve.engine.vision.media import VisionPrice


@dataclass
class SchedulerState:
    """Where every request is, and the parts of the next plan gathered so far."""

    table: RowTable  # every row that holds state
    waiting: deque[Request] = field(default_factory=deque)  # queued parents, FIFO
    prefilling: list[Request] = field(default_factory=list)  # rows consuming their prompt
    decoding: list[Request] = field(default_factory=list)  # decode batch, in row order
    # For the next plan: rows admitted, forks of finished prefills, prefix-cache saves
    new_rows: list[NewRow] = field(default_factory=list)
    forks: list[tuple[str, str]] = field(default_factory=list)
    saves: list[CacheSave] = field(default_factory=list)
    price: VisionPrice = field(default_factory=VisionPrice)  # tower blocks' cost this step
    ahead_seconds: float = 0.0  # predicted cost of the run-ahead step just planned (0: none)
    num_draft_tokens: int = 0  # drafts the decode rows verify this step (speculation)

    def clear_plan(self) -> None:
        """Forget what the next plan was to carry (the workers were reset)."""
        self.new_rows, self.forks, self.saves = [], [], []
        self.ahead_seconds = 0.0
