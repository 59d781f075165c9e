"""The Responses API's framing of a run (pipeline.Writer): output items and stream events.

A choice's ordered output pieces become output items, one per run of a kind: reasoning
-> a `reasoning` item (reasoning_text content), answer text -> an assistant `message`
(one output_text part), each tool call -> a `function_call` item. One state machine
builds them, for both modes: streaming sends its events as pieces arrive; a non-streamed
response feeds the finished choice's pieces through it and keeps only the items.

Stream (named SSE events, each with a sequence_number, no [DONE]):

    response.created, response.in_progress              the response, in_progress
    per item: response.output_item.added
      message / reasoning: response.content_part.added, response.output_text.delta /
        response.reasoning_text.delta ..., response.output_text.done /
        response.reasoning_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ..., .done
    response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it short)

A failure after the stream started is an `error` event. The finished Response goes to
`on_done` (the route stores it when asked to).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deltaserve.server.errors import APIError
from deltaserve.server.frontend.pieces import Piece, Text, ToolCallStart
from deltaserve.server.frontend.responses_input import new_item_id
from deltaserve.server.pipeline import FinishedChoice
from deltaserve.server.responses_api import (
    FunctionCallOut,
    IncompleteDetails,
    InputTokensDetails,
    MessageOut,
    OutputItemOut,
    OutputTextOut,
    OutputTokensDetails,
    ReasoningOut,
    ReasoningTextOut,
    ResponseOut,
    ResponseUsage,
)
from deltaserve.server.routes_generation import ChoiceEvent, TokenCounts
from deltaserve.server.sse import KEEPALIVE, sse_event

TextItem = MessageOut | ReasoningOut


class ResponsesWriter:
    """Response objects and response.* stream events (see the module docstring)."""

    keepalive = KEEPALIVE
    route = "responses"

    def __init__(
        self,
        response: ResponseOut,
        parallel_tool_calls: bool,
        count_tokens: Callable[[str], int],
        on_done: Callable[[ResponseOut], None],
    ) -> None:
        self.response = response  # in_progress, no output yet: the head of every event
        self.response_id = response.id
        self.is_parallel = parallel_tool_calls
        self.count_tokens = count_tokens  # for usage's reasoning_tokens
        self.on_done = on_done
        self.items: list[OutputItemOut] = []  # output so far; the last may be open
        self.open_item: OutputItemOut | None = None
        self.finish_reason: str | None = None
        self.num_events = 0  # the next event's sequence_number

    def head(self, counts: TokenCounts) -> list[bytes]:
        """response.created and response.in_progress."""
        response = self.response.model_dump(mode="json")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def event(self, event: ChoiceEvent) -> list[bytes]:
        """Item events for each piece; at the end the open item closes."""
        out = [chunk for piece in event.delta.pieces for chunk in self._piece(piece)]
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            out += self._close()
        return out

    def tail(self, counts: TokenCounts) -> list[bytes]:
        """response.completed (or response.incomplete) with the whole response."""
        final = self._finish(counts)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        return [self._event(kind, response=final.model_dump(mode="json"))]

    def error(self, err: APIError) -> bytes:
        """An `error` event (the spec's ResponseErrorEvent)."""
        return self._event("error", code=err.code, message=err.message, param=err.param)

    def body(self, choices: list[FinishedChoice], counts: TokenCounts) -> ResponseOut:
        """The finished Response: the choice's pieces run through the same items."""
        (choice,) = choices
        for piece in choice.result.pieces:
            self._piece(piece)
        self.finish_reason = choice.finish_reason
        self._close()
        return self._finish(counts)

    def _finish(self, counts: TokenCounts) -> ResponseOut:
        is_cut = self.finish_reason == "length"
        reasoning = "".join(
            part.text for item in self.items if isinstance(item, ReasoningOut)
            for part in item.content
        )  # fmt: skip
        usage = ResponseUsage(
            input_tokens=counts.num_prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=counts.num_cached),
            output_tokens=counts.num_output,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=min(counts.num_output, self.count_tokens(reasoning))
            ),
            total_tokens=counts.num_prompt + counts.num_output,
        )
        final = self.response.model_copy(
            update={
                "status": "incomplete" if is_cut else "completed",
                "completed_at": None if is_cut else int(time.time()),
                "incomplete_details": IncompleteDetails(reason="max_output_tokens")
                if is_cut
                else None,
                "output": list(self.items),
                "usage": usage,
            }
        )
        self.on_done(final)
        return final

    def _piece(self, piece: Piece) -> list[bytes]:
        if isinstance(piece, Text):
            return self._text(piece)
        if not self.is_parallel and piece.index > 0:
            return []  # parallel_tool_calls=false: only the first call goes out
        if isinstance(piece, ToolCallStart):
            call = FunctionCallOut(
                id=new_item_id("function_call"), status="in_progress",
                call_id=piece.id, name=piece.name, arguments="",
            )  # fmt: skip
            return [*self._close(), self._add(call)]
        call = self.open_item
        assert isinstance(call, FunctionCallOut), "arguments before their call's start"
        call.arguments += piece.fragment
        return [self._item_event("response.function_call_arguments.delta", delta=piece.fragment)]

    def _text(self, piece: Text) -> list[bytes]:
        is_reasoning = piece.kind == "reasoning"
        out: list[bytes] = []
        item = self.open_item
        if not isinstance(item, ReasoningOut if is_reasoning else MessageOut):
            out += self._close()
            item = self._new_text_item(is_reasoning)
            out.append(self._add(item))
            part = item.content[0].model_dump(mode="json")
            out.append(self._item_event("response.content_part.added", content_index=0, part=part))
        item.content[0].text += piece.text
        fields: dict[str, Any] = {"content_index": 0, "delta": piece.text}
        if is_reasoning:
            return [*out, self._item_event("response.reasoning_text.delta", **fields)]
        return [*out, self._item_event("response.output_text.delta", **fields, logprobs=[])]

    def _new_text_item(self, is_reasoning: bool) -> TextItem:
        if is_reasoning:
            return ReasoningOut(
                id=new_item_id("reasoning"), status="in_progress",
                content=[ReasoningTextOut(text="")],
            )  # fmt: skip
        return MessageOut(
            id=new_item_id("message"), status="in_progress", content=[OutputTextOut(text="")]
        )

    def _add(self, item: OutputItemOut) -> bytes:
        self.items.append(item)
        self.open_item = item
        shown = item.model_dump(mode="json")
        if isinstance(item, TextItem):
            shown["content"] = []  # parts are added by their own event
        return self._event(
            "response.output_item.added", output_index=len(self.items) - 1, item=shown
        )

    def _close(self) -> list[bytes]:
        item = self.open_item
        if item is None:
            return []
        self.open_item = None
        item.status = "incomplete" if self.finish_reason == "length" else "completed"
        out: list[bytes] = []
        if isinstance(item, FunctionCallOut):
            args = {"name": item.name, "arguments": item.arguments}
            out.append(self._item_event("response.function_call_arguments.done", **args))
        else:
            part = item.content[0]
            kind = "reasoning_text" if isinstance(item, ReasoningOut) else "output_text"
            extra: dict[str, Any] = {} if kind == "reasoning_text" else {"logprobs": []}
            text = {"content_index": 0, "text": part.text, **extra}
            out.append(self._item_event(f"response.{kind}.done", **text))
            shown = part.model_dump(mode="json")
            out.append(self._item_event("response.content_part.done", content_index=0, part=shown))
        index, shown = len(self.items) - 1, item.model_dump(mode="json")
        return [*out, self._event("response.output_item.done", output_index=index, item=shown)]

    def _item_event(self, kind: str, **fields: Any) -> bytes:
        """An event about the open (last) item."""
        item = self.items[-1]
        return self._event(kind, item_id=item.id, output_index=len(self.items) - 1, **fields)

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return sse_event(kind, payload)
