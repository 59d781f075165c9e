"""Streaming parser for Qwen3.5's XML tool calls, and the non-streaming wrapper over it.

What the model writes (several calls may follow one another):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The parser turns that into a call start (index, id, name) and JSON argument fragments:
`{"city": "Paris"` then `}`. String values stream as they are generated; typed values
(integer, object, …) go out whole when their parameter closes. The fragments of one call
always concatenate to a JSON object, even when the stream is cut mid-call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from deltaserve.models.chat_format import (
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    PARAMETER_VALUE_ENDS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)
from deltaserve.server.frontend.pieces import Piece, Text, ToolCallArgs, ToolCallStart, merge_pieces
from deltaserve.server.frontend.stops import find_first, partial_match_len
from deltaserve.server.frontend.tool_schema import ToolSchemas, typed_value

# The parser's output: content Text and tool-call pieces (server/frontend/pieces.py).
ToolDelta = Piece


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call (non-streaming responses). `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


def new_tool_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class _OpenCall:
    index: int
    name: str
    num_params: int = 0
    param_is_string: bool = True
    param_types: frozenset[str] = frozenset()
    value: str = ""  # the raw text of a typed value, sent whole when it closes
    strip_value_newline: bool = True  # the "\n" after "<parameter=…>" is markup


class ToolCallParser:
    """Streaming tool-call parser over content text (reasoning already split off).

    States: "text" (content, watching for `<tool_call>`), "call" (inside `<tool_call>`,
    before or between functions), "function" (between parameters), "value" (inside a
    parameter). Whitespace around a tool call block is markup and is dropped. A
    `<tool_call>` that is not followed by `<function=…>` is given back as content.
    """

    def __init__(self, tools: list[dict] | None) -> None:
        self._schemas = ToolSchemas(tools)
        self._state = "text"
        self._buffer = ""
        self._call: _OpenCall | None = None
        self._num_calls = 0
        self._can_revert = False  # inside "<tool_call>" and no function started yet
        self._space_before_call = ""  # given back with the tag if it was no tool call
        self._strip_leading_space = False  # right after "</tool_call>"
        self._out: list[ToolDelta] = []

    @property
    def num_calls(self) -> int:
        """How many tool calls have started so far."""
        return self._num_calls

    def push(self, text: str) -> list[ToolDelta]:
        """Add content text; return the deltas that are now certain."""
        self._buffer += text
        while self._step():
            pass
        return self._take()

    def flush(self) -> list[ToolDelta]:
        """End of stream: close an open call (arguments stay valid JSON), emit held text."""
        self.push("")
        if self._state == "text":
            self._flush_text()
        elif self._state == "call" and self._can_revert:
            self._emit_content(self._space_before_call + TOOL_CALL_OPEN + self._buffer)
        elif self._state == "value":
            partial = partial_match_len(self._buffer, PARAMETER_VALUE_ENDS)
            self._close_value(self._buffer[: len(self._buffer) - partial])
            self._close_call()
        elif self._state == "function":
            self._close_call()
        self._buffer, self._state = "", "text"
        return self._take()

    def _step(self) -> bool:
        """Consume what the buffer allows; return True when the state changed."""
        if self._state == "text":
            return self._step_text()
        if self._state == "call":
            return self._step_call()
        if self._state == "function":
            return self._step_function()
        return self._step_value()

    def _step_text(self) -> bool:
        if self._strip_leading_space:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._strip_leading_space = False
        start = self._buffer.find(TOOL_CALL_OPEN)
        if start >= 0:
            before = self._buffer[:start]
            self._emit_content(before.rstrip())
            self._space_before_call = before[len(before.rstrip()) :]
            self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
            self._state, self._can_revert = "call", True
            return True
        # Hold a partial "<tool_call>" and trailing whitespace: both may precede a call.
        partial = partial_match_len(self._buffer, (TOOL_CALL_OPEN,))
        ready = self._buffer[: len(self._buffer) - partial].rstrip()
        self._emit_content(ready)
        self._buffer = self._buffer[len(ready) :]
        return False

    def _step_call(self) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(FUNCTION_OPEN):
            end = head.find(">", len(FUNCTION_OPEN))
            if end < 0:
                return False  # the name is not complete yet
            self._start_call(head[len(FUNCTION_OPEN) : end].strip())
            self._buffer = head[end + 1 :]
            return True
        if head.startswith(TOOL_CALL_CLOSE):
            self._buffer = head[len(TOOL_CALL_CLOSE) :]
            self._state, self._strip_leading_space = "text", True
            return True
        if any(tag.startswith(head) for tag in (FUNCTION_OPEN, TOOL_CALL_CLOSE)):
            return False  # empty or a partial tag: wait
        if self._can_revert:
            # Not a tool call after all: the tag was text. Re-scan the rest as text.
            self._emit_content(self._space_before_call + TOOL_CALL_OPEN)
            self._state = "text"
            return True
        self._buffer = _skip_to_next_tag(head)
        return True

    def _step_function(self) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(PARAMETER_OPEN):
            end = head.find(">", len(PARAMETER_OPEN))
            if end < 0:
                return False
            self._open_param(head[len(PARAMETER_OPEN) : end].strip())
            self._buffer = head[end + 1 :]
            return True
        for tag, state in ((FUNCTION_CLOSE, "call"), (TOOL_CALL_CLOSE, "text")):
            if head.startswith(tag):
                self._close_call()
                self._buffer = head[len(tag) :]
                self._state, self._strip_leading_space = state, state == "text"
                return True
        if any(tag.startswith(head) for tag in (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)):
            self._buffer = head
            return False
        self._buffer = _skip_to_next_tag(head)  # stray text between parameters
        return True

    def _step_value(self) -> bool:
        call = self._call
        assert call is not None, "a parameter value outside a call"
        if call.strip_value_newline and self._buffer:
            call.strip_value_newline = False
            self._buffer = self._buffer.removeprefix("\n")
        found = find_first(self._buffer, PARAMETER_VALUE_ENDS)
        if found is not None:
            start, tag = found
            self._close_value(self._buffer[:start])
            # Only "</parameter>" belongs to the value; other tags are the next state's.
            self._buffer = self._buffer[start + (len(tag) if tag == PARAMETER_CLOSE else 0) :]
            self._state = "function"
            return True
        partial = partial_match_len(self._buffer, PARAMETER_VALUE_ENDS)
        ready = self._buffer[: len(self._buffer) - partial]
        if ready.endswith("\n"):
            ready = ready[:-1]  # may be the newline before "</parameter>": hold it
        self._add_value(ready)
        self._buffer = self._buffer[len(ready) :]
        return False

    def _start_call(self, name: str) -> None:
        self._call = _OpenCall(index=self._num_calls, name=name)
        self._out.append(ToolCallStart(self._num_calls, new_tool_call_id(), name))
        self._num_calls += 1
        self._state, self._can_revert = "function", False

    def _open_param(self, name: str) -> None:
        call = self._call
        assert call is not None, "a parameter outside a call"
        call.param_types = self._schemas.param_types(call.name, name)
        call.param_is_string = self._schemas.is_string(call.param_types)
        call.value, call.strip_value_newline = "", True
        opening = "{" if call.num_params == 0 else ", "
        quote = '"' if call.param_is_string else ""
        self._emit_args(f"{opening}{json.dumps(name, ensure_ascii=False)}: {quote}")
        call.num_params += 1
        self._state = "value"

    def _add_value(self, text: str) -> None:
        call = self._call
        assert call is not None
        if not text:
            return
        if call.param_is_string:
            # JSON escaping is per character, so escaped pieces join to the escaped whole.
            self._emit_args(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            call.value += text

    def _close_value(self, text: str) -> None:
        call = self._call
        assert call is not None
        self._add_value(text.removesuffix("\n"))
        if call.param_is_string:
            self._emit_args('"')
        else:
            value = typed_value(call.value, call.param_types)
            self._emit_args(json.dumps(value, ensure_ascii=False))

    def _close_call(self) -> None:
        call = self._call
        assert call is not None, "closing a call that never started"
        self._emit_args("}" if call.num_params else "{}")
        self._call = None

    def _flush_text(self) -> None:
        text = self._buffer.lstrip() if self._strip_leading_space else self._buffer
        self._emit_content(text)

    def _emit_content(self, text: str) -> None:
        if text:
            self._out.append(Text("content", text))

    def _emit_args(self, fragment: str) -> None:
        assert self._call is not None
        self._out.append(ToolCallArgs(self._call.index, fragment))

    def _take(self) -> list[ToolDelta]:
        out, self._out = merge_pieces(self._out), []
        return out


def _skip_to_next_tag(text: str) -> str:
    """Drop stray text up to the next "<" (keeping it), or all of it."""
    next_tag = text.find("<", 1)
    return text[next_tag:] if next_tag > 0 else ""


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
    """Non-streaming parse of a whole content text: (content, tool calls).

    Built on the streaming parser, so both paths agree on every input.
    """
    parser = ToolCallParser(tools)
    collector = ToolCallCollector()
    collector.add(parser.push(text))
    collector.add(parser.flush())
    return collector.content, collector.calls()


class ToolCallCollector:
    """Accumulates tool deltas into the final content text and complete calls."""

    def __init__(self) -> None:
        self.content = ""
        self._starts: list[ToolCallStart] = []
        self._arguments: list[str] = []

    def add(self, deltas: list[ToolDelta]) -> None:
        """Fold in deltas from ToolCallParser.push/flush, in order."""
        for delta in deltas:
            if isinstance(delta, Text):
                self.content += delta.text
            elif isinstance(delta, ToolCallStart):
                self._starts.append(delta)
                self._arguments.append("")
            else:
                self._arguments[delta.index] += delta.fragment

    def calls(self) -> list[ToolCall]:
        """The calls seen so far (complete once the parser was flushed)."""
        return [
            ToolCall(start.id, start.name, arguments)
            for start, arguments in zip(self._starts, self._arguments, strict=True)
        ]
