"""One choice's output pipeline: token ids -> text -> stop strings -> reasoning -> tools.

A ChoiceStream turns the engine's RequestOutput deltas for one choice into what the
OpenAI responses need, streaming or not: content, reasoning, tool-call chunks, logprobs,
and whether a stop string ended the text (then the route aborts the engine request).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.types import RequestOutput, TokenLogprob
from server.frontend.detokenizer import IncrementalDetokenizer
from server.frontend.reasoning import Delta, ReasoningParser
from server.frontend.stops import StopStringMatcher
from server.frontend.tokenizer import TextTokenizer
from server.frontend.tools import (
    ContentDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallCollector,
    ToolCallParser,
    ToolCallStart,
    ToolDelta,
)


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class LogprobEntry:
    """The sampled token at one position, its logprob and the top alternatives."""

    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class ToolCallChunk:
    """A streamed tool-call delta in OpenAI's shape: `id` and `name` only on a call's
    first chunk, `arguments` a JSON fragment (possibly "")."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class ChoiceDelta:
    """What one push produced for a choice; empty fields mean nothing new."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallChunk] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    stop_hit: bool = False  # a stop string ended the text: abort the engine request

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to send (a stop hit still counts as something)."""
        return not (self.content or self.reasoning or self.tool_calls or self.logprobs)


@dataclass(frozen=True)
class ChoiceResult:
    """The whole choice, for non-streaming responses."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    logprobs: tuple[LogprobEntry, ...]


class ChoiceStream:
    """The frontend pipeline of one choice: push engine outputs, get deltas.

    tokenizer: the server's TextTokenizer (for decoding and logprob token text).
    stops: stop strings; text ends before the first one and `stop_hit` is reported.
    tools: the request's tools (their schemas type the parameter values).
    starts_in_reasoning: from TextTokenizer.render_chat (prompt ended inside `<think>`).
    parse_tools / parse_reasoning: off for /v1/completions (raw text).
    hidden_token_ids: extra ids whose text is dropped (e.g. the request's stop ids);
    EOS and other control tokens are always dropped.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        stops: Sequence[str] = (),
        tools: list[dict] | None = None,
        starts_in_reasoning: bool = False,
        parse_tools: bool = True,
        parse_reasoning: bool = True,
        hidden_token_ids: Iterable[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._hidden = tokenizer.hidden_token_ids | frozenset(hidden_token_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stops)
        self._reasoning = ReasoningParser(starts_in_reasoning) if parse_reasoning else None
        self._tools = ToolCallParser(tools) if parse_tools else None
        self._collector = ToolCallCollector()
        self._reasoning_text = ""
        self._logprobs: list[LogprobEntry] = []
        self._is_finished = False

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string ended the text (later outputs are ignored)."""
        return self._stops.is_stopped

    @property
    def has_tool_calls(self) -> bool:
        """Whether the model called at least one tool."""
        return self._tools is not None and self._tools.num_calls > 0

    def push(self, output: RequestOutput) -> ChoiceDelta:
        """Feed one engine delta of this choice; return what is now ready to send."""
        if self.is_stopped or self._is_finished:
            return ChoiceDelta(stop_hit=self.is_stopped)
        visible = [t for t in output.token_ids if t not in self._hidden]
        delta = ChoiceDelta(logprobs=self._logprob_entries(output.logprobs))
        text, delta.stop_hit = self._stops.push(self._detokenizer.push(visible))
        self._parse(text, delta, final=False)
        return delta

    def finish(self) -> ChoiceDelta:
        """End of the choice: flush everything held back. Call once, after the last push."""
        delta = ChoiceDelta(stop_hit=self.is_stopped)
        if self._is_finished:
            return delta
        self._is_finished = True
        text = ""
        if not self.is_stopped:
            text, delta.stop_hit = self._stops.push(self._detokenizer.flush())
        text += self._stops.flush()
        self._parse(text, delta, final=True)
        return delta

    def finish_reason(self, engine_reason: str | None) -> str:
        """The OpenAI finish_reason, given the engine's for this choice.

        A stop string wins (the route aborted the request because of it); a choice that
        ended normally after calling tools reports "tool_calls".
        """
        if self.is_stopped:
            return "stop"
        if engine_reason in (None, "stop") and self.has_tool_calls:
            return "tool_calls"
        return engine_reason or "stop"

    def result(self) -> ChoiceResult:
        """Everything emitted so far (after finish(): the whole choice)."""
        return ChoiceResult(
            content=self._collector.content,
            reasoning=self._reasoning_text,
            tool_calls=tuple(self._collector.calls()),
            logprobs=tuple(self._logprobs),
        )

    def _parse(self, text: str, delta: ChoiceDelta, final: bool) -> None:
        """Run text through reasoning and tool parsing into `delta`."""
        if self._reasoning is None:
            parts = [Delta("content", text)]
        else:
            parts = self._reasoning.push(text) + (self._reasoning.flush() if final else [])
        content = "".join(part.text for part in parts if part.kind == "content")
        delta.reasoning = "".join(part.text for part in parts if part.kind == "reasoning")
        self._reasoning_text += delta.reasoning
        if self._tools is None:
            tool_deltas: list[ToolDelta] = [ContentDelta(content)] if content else []
        else:
            tool_deltas = self._tools.push(content) + (self._tools.flush() if final else [])
        self._collector.add(tool_deltas)
        delta.content = "".join(d.text for d in tool_deltas if isinstance(d, ContentDelta))
        delta.tool_calls = tool_call_chunks(tool_deltas)

    def _logprob_entries(self, logprobs: tuple[TokenLogprob, ...] | None) -> list[LogprobEntry]:
        """One entry per visible token (hidden ones, like EOS, have no text to align)."""
        entries = [self._entry(lp) for lp in logprobs or () if lp.token_id not in self._hidden]
        self._logprobs += entries
        return entries

    def _entry(self, logprob: TokenLogprob) -> LogprobEntry:
        text, raw = self._tokenizer.token_text, self._tokenizer.token_bytes
        top = tuple(TopLogprob(text(t), raw(t), lp) for t, lp in logprob.top)
        token_id = logprob.token_id
        return LogprobEntry(text(token_id), raw(token_id), logprob.logprob, top)


def tool_call_chunks(deltas: list[ToolDelta]) -> list[ToolCallChunk]:
    """Tool deltas in OpenAI's streaming shape: a call's start and following argument
    fragments merge into one chunk per call index."""
    chunks: list[ToolCallChunk] = []
    for delta in deltas:
        if isinstance(delta, ToolCallStart):
            chunks.append(ToolCallChunk(delta.index, delta.id, delta.name, ""))
        elif isinstance(delta, ToolCallArgs):
            last = chunks[-1] if chunks else None
            if last is not None and last.index == delta.index:
                chunks[-1] = ToolCallChunk(
                    last.index, last.id, last.name, last.arguments + delta.fragment
                )
            else:
                chunks.append(ToolCallChunk(delta.index, None, None, delta.fragment))
    return chunks
