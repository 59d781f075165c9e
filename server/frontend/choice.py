"""One choice's output pipeline: token ids -> text -> stop strings -> reasoning -> tools.

A ChoiceStream turns the engine's RequestOutput deltas for one choice into ordered output
pieces (server/frontend/pieces.py) plus logprobs, and says whether a stop string ended the
text (then the run aborts the engine request). What it produces is protocol-neutral:
each protocol's writer reads the pieces (OpenAI through the content / reasoning /
tool_calls views below, Anthropic block by block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from deltaserve.engine.types import RequestOutput, TokenLogprob
from deltaserve.server.frontend.detokenizer import IncrementalDetokenizer
from deltaserve.server.frontend.pieces import (
    Piece,
    Text,
    ToolCallArgs,
    ToolCallStart,
    extend_merged,
    merge_pieces,
    text_of,
)
from deltaserve.server.frontend.reasoning import ReasoningParser
from deltaserve.server.frontend.stops import StopStringMatcher
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.frontend.tools import ToolCall, ToolCallCollector, ToolCallParser


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


class _TextViews:
    """The answer and thinking text of a choice's ordered pieces (tool-call markup is
    never text)."""

    pieces: Sequence[Piece]

    @property
    def content(self) -> str:
        """The answer text."""
        return text_of(self.pieces, "content")

    @property
    def reasoning(self) -> str:
        """The thinking text."""
        return text_of(self.pieces, "reasoning")


@dataclass
class ChoiceDelta(_TextViews):
    """What one push produced for a choice, in generation order; empty means nothing new."""

    pieces: list[Piece] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    stop_hit: bool = False  # a stop string ended the text: abort the engine request

    @property
    def tool_calls(self) -> list[ToolCallChunk]:
        """The tool-call pieces in OpenAI's streaming shape."""
        return tool_call_chunks(self.pieces)

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to send (a stop hit still counts as something)."""
        return not (self.pieces or self.logprobs)

    def then(self, later: ChoiceDelta) -> ChoiceDelta:
        """This delta followed by `later` (e.g. a push and the final flush) as one."""
        pieces = extend_merged(list(self.pieces), later.pieces)
        stop_hit = self.stop_hit or later.stop_hit
        return ChoiceDelta(pieces, self.logprobs + later.logprobs, stop_hit)


@dataclass(frozen=True)
class ChoiceResult(_TextViews):
    """The whole choice, for non-streaming responses."""

    pieces: tuple[Piece, ...]  # merged: one piece per text run or tool call part
    logprobs: tuple[LogprobEntry, ...]
    stop_string: str | None  # the stop string that ended the text, if one did

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The complete tool calls, in order."""
        collector = ToolCallCollector()
        collector.add([p for p in self.pieces if not isinstance(p, Text)])
        return tuple(collector.calls())


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
        # Everything emitted so far, merged only when result() is asked for (streams never
        # do): joining each delta into the text so far would copy it per token.
        self._pieces: list[Piece] = []
        self._logprobs: list[LogprobEntry] = []
        self._is_finished = False

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string ended the text (later outputs are ignored)."""
        return self._stops.is_stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

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
        pieces = tuple(merge_pieces(self._pieces))
        return ChoiceResult(pieces, tuple(self._logprobs), self.stop_string)

    def _parse(self, text: str, delta: ChoiceDelta, final: bool) -> None:
        """Run text through reasoning and tool parsing into `delta`, keeping the order."""
        if self._reasoning is None:
            parts = [Text("content", text)] if text else []
        else:
            parts = self._reasoning.push(text) + (self._reasoning.flush() if final else [])
        if self._tools is None and not final:
            # Per token, the common case: the parts are merged already (the reasoning
            # parser merges what it returns), so they are the delta's pieces as they are.
            delta.pieces = parts  # type: ignore[assignment]  # Text pieces
            self._pieces += parts
            return
        pieces: list[Piece] = []
        for part in parts:
            # Only the answer can call tools; thinking is passed through as it is.
            is_plain = part.kind == "reasoning" or self._tools is None
            extend_merged(pieces, [part] if is_plain else self._tools.push(part.text))
        if final and self._tools is not None:
            extend_merged(pieces, self._tools.flush())
        delta.pieces = pieces
        self._pieces += pieces

    def _logprob_entries(self, logprobs: tuple[TokenLogprob, ...] | None) -> list[LogprobEntry]:
        """One entry per visible token (hidden ones, like EOS, have no text to align)."""
        if not logprobs:
            return []
        entries = [self._entry(lp) for lp in logprobs if lp.token_id not in self._hidden]
        self._logprobs += entries
        return entries

    def _entry(self, logprob: TokenLogprob) -> LogprobEntry:
        text, raw = self._tokenizer.token_text, self._tokenizer.token_bytes
        top = tuple(TopLogprob(text(t), raw(t), lp) for t, lp in logprob.top)
        token_id = logprob.token_id
        return LogprobEntry(text(token_id), raw(token_id), logprob.logprob, top)


def tool_call_chunks(pieces: list[Piece]) -> list[ToolCallChunk]:
    """The tool-call pieces of a merged list in OpenAI's streaming shape: a call's start
    carries its first argument fragment, later fragments carry only their index."""
    chunks: list[ToolCallChunk] = []
    for piece in pieces:
        if isinstance(piece, ToolCallStart):
            chunks.append(ToolCallChunk(piece.index, piece.id, piece.name, ""))
        elif isinstance(piece, ToolCallArgs):
            last = chunks[-1] if chunks else None
            if last is not None and last.index == piece.index:
                arguments = last.arguments + piece.fragment
                chunks[-1] = ToolCallChunk(last.index, last.id, last.name, arguments)
            else:
                chunks.append(ToolCallChunk(piece.index, None, None, piece.fragment))
    return chunks
