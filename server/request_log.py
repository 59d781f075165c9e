"""Per-request records: one typed record and one info log line for every generating
request that ends, and a bounded ring of the latest records for the status page.

A request gets its record when it ends, however it ends: every choice finished (its
finish reasons), the client went away first, or it failed after generation started.
Requests refused before that (400, 429) get none: uvicorn's access log shows those.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("deltaserve.requests")

CLIENT_GONE = "client went away"


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the operator sees it. Written by server/pipeline.py."""

    request_id: str  # the response's id, as its client saw it (chatcmpl-..., msg_...)
    route: str  # the protocol: "chat", "completions" or "messages"
    num_prompt: int  # prompt tokens (summed over the prompts of a /v1/completions list)
    num_cached: int  # of those, restored from the engine's prefix cache
    num_output: int  # tokens generated, all choices
    ttft_s: float | None  # arrival to the first generated token; None: no token came
    tokens_per_s: float | None  # tokens after the first, over the time they took
    finish: str  # finish reason(s) ("stop", "length", "tool_calls"; several joined by
    # ","), CLIENT_GONE, or "error: <message>"
    finished_at: float  # wall-clock time (time.time()) the request ended
    duration_s: float  # arrival to end

    def log_line(self) -> str:
        """The record as one `key=value` line (grep-able; the finish reason last, as it
        may contain spaces)."""
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}s"
        rate = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:.1f}"
        return (
            f"request {self.request_id} route={self.route} prompt={self.num_prompt} "
            f"cached={self.num_cached} completion={self.num_output} ttft={ttft} "
            f"tokens/s={rate} duration={self.duration_s:.3f}s finish={self.finish}"
        )

    def as_json(self) -> dict[str, Any]:
        """The record's fields, for the status page's JSON."""
        return asdict(self)


class RequestLog:
    """Logs each record at info level and keeps the latest `capacity` of them.

    Used from the event loop's thread only (routes add, the status route reads).
    """

    def __init__(self, capacity: int = 200) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self.num_finished = 0  # records added since start (the ring forgets, this not)

    def add(self, record: RequestRecord) -> None:
        """Log `record` and keep it (the oldest one drops out when the ring is full)."""
        logger.info("%s", record.log_line())
        self._records.append(record)
        self.num_finished += 1

    def recent(self) -> list[RequestRecord]:
        """The kept records, newest first."""
        return list(reversed(self._records))
