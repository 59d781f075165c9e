"""Splits a generated text stream into reasoning (inside `<think>`) and content.

Qwen3.5 thinks once, at the start of its answer: `<think>\\n…\\n</think>\\n\\n…`. When the
chat template's generation prompt already opened `<think>\\n` (enable_thinking, the
default), the output starts inside reasoning without an opening tag. The tags and the
newlines the template puts around them are never emitted.
"""

from __future__ import annotations

from deltaserve.models.chat_format import THINK_CLOSE, THINK_OPEN
from deltaserve.server.frontend.pieces import Text, TextKind, merge_pieces
from deltaserve.server.frontend.stops import partial_match_len

# The reasoning parser's output is plain Text pieces; the old names stay for readers.
Delta = Text
DeltaKind = TextKind


class ReasoningParser:
    """Streaming `<think>` splitter: push text chunks, get content/reasoning deltas.

    States: "start" (nothing seen yet; a `<think>` may still open, after optional
    whitespace), "reasoning" (until `</think>`), "content" (everything else, for good).
    A `<think>` later in the content is just text: the model thinks only at the start.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buffer = ""
        # Newlines still to drop at the front of upcoming text: the template writes
        # "<think>\n" and "</think>\n\n", and those belong to the markup, not the text.
        self._newlines_to_strip = 0

    @property
    def in_reasoning(self) -> bool:
        """Whether the text pushed so far ends inside the reasoning block."""
        return self._state == "reasoning"

    def push(self, text: str) -> list[Delta]:
        """Add generated text; return the deltas that are now certain."""
        if self._state == "content" and not (self._buffer or self._newlines_to_strip):
            return [Delta("content", text)] if text else []  # the answer, as it comes
        self._buffer += text
        deltas: list[Delta] = []
        while self._step(deltas):
            pass
        return merge_pieces(deltas)  # type: ignore[return-value]  # Text in, Text out

    def flush(self) -> list[Delta]:
        """End of stream: emit whatever was held back, in the current state's kind."""
        self._strip_newlines()
        text, self._buffer = self._buffer, ""
        kind: DeltaKind = "reasoning" if self._state == "reasoning" else "content"
        return [Delta(kind, text)] if text else []

    def _step(self, deltas: list[Delta]) -> bool:
        """Consume what the buffer allows; return True when the state changed."""
        self._strip_newlines()
        if self._state == "start":
            return self._step_start()
        if self._state == "reasoning":
            return self._step_reasoning(deltas)
        if self._buffer:
            deltas.append(Delta("content", self._buffer))
            self._buffer = ""
        return False

    def _step_start(self) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(THINK_OPEN):
            self._buffer = head[len(THINK_OPEN) :]
            self._state = "reasoning"
            self._newlines_to_strip = 1
            return True
        if THINK_OPEN.startswith(head):
            return False  # only whitespace or a partial "<think>" so far: wait
        self._state = "content"
        return True

    def _step_reasoning(self, deltas: list[Delta]) -> bool:
        close = self._buffer.find(THINK_CLOSE)
        if close >= 0:
            reasoning = self._buffer[:close]
            # The template writes "\n</think>"; that newline is markup too.
            deltas.append(Delta("reasoning", reasoning.removesuffix("\n")))
            self._buffer = self._buffer[close + len(THINK_CLOSE) :]
            self._state = "content"
            self._newlines_to_strip = 2
            return True
        num_held = partial_match_len(self._buffer, (THINK_CLOSE,))
        ready = self._buffer[: len(self._buffer) - num_held]
        if ready.endswith("\n"):
            ready = ready[:-1]  # it may be the newline before "</think>": hold it
        deltas.append(Delta("reasoning", ready))
        self._buffer = self._buffer[len(ready) :]
        return False

    def _strip_newlines(self) -> None:
        while self._newlines_to_strip and self._buffer:
            if self._buffer[0] != "\n":
                self._newlines_to_strip = 0
                break
            self._buffer = self._buffer[1:]
            self._newlines_to_strip -= 1
