"""Stored /v1/responses: a bounded in-memory LRU for previous_response_id and GET.

Each entry is the Response object as sent (JSON) and its input items, earlier turns
included: continuing a response needs only that one entry (its items, then its output),
so evicting an older turn never breaks a newer one. The price is that a conversation's
history is held once per stored turn; both bounds (count and JSON bytes, from
settings.responses) count it. Lives on the event loop only: no locking.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from deltaserve.server.errors import APIError
from deltaserve.server.settings import ResponseStoreSettings


@dataclass(frozen=True)
class StoredResponse:
    """One stored response."""

    response: dict[str, Any]  # the Response object, as GET returns it
    items: list[dict[str, Any]]  # its input items (item resources, with ids), oldest first
    num_bytes: int  # JSON size of both, what the byte bound counts

    def context(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from: its input, then its output."""
        return [*self.items, *self.response["output"]]


class ResponseStore:
    """Responses by id, least recently used evicted first (by count and by bytes)."""

    def __init__(self, max_stored: int, max_bytes: int) -> None:
        self.max_stored = max_stored
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @classmethod
    def from_settings(cls, settings: ResponseStoreSettings) -> ResponseStore:
        """A store with the configured bounds."""
        return cls(settings.max_stored, settings.max_stored_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep `response` (by its id) with its input items; False when it alone is over
        a bound (then nothing is kept, nothing evicted)."""
        num_bytes = len(json.dumps(response)) + len(json.dumps(items))
        if self.max_stored < 1 or num_bytes > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, items, num_bytes)
        self.num_bytes += num_bytes
        while len(self._entries) > self.max_stored or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        return True

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response (now the most recently used); a 404 naming the id, in
        OpenAI's error shape, when it was never stored, was deleted or was evicted.
        param: the request field that named it, for the error."""
        entry = self._entries.get(response_id)
        if entry is None:
            what = "Previous response" if param == "previous_response_id" else "Response"
            message = f"{what} with id '{response_id}' not found."
            raise APIError(404, message, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True
