"""The pieces a choice's output is made of, in generation order, and the one merge rule.

The parsers emit pieces (reasoning split: Text; tool-call parser: Text, ToolCallStart,
ToolCallArgs); ChoiceDelta carries them in order; every protocol reads them. OpenAI
projects them onto content / reasoning_content / tool_calls; Anthropic turns each run of
one kind into a content block (thinking, text, tool_use), where the order matters.

`extend_merged` is the only place deltas are merged: parsers, choices and runs use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

TextKind = Literal["content", "reasoning"]


class Text(NamedTuple):
    """Generated text of one kind: the answer ("content") or thinking ("reasoning")."""

    kind: TextKind
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A new tool call: `index` counts calls in this choice from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """A fragment of a call's JSON arguments; a call's fragments join to one JSON object."""

    index: int
    fragment: str


Piece = Text | ToolCallStart | ToolCallArgs


def extend_merged(merged: list[Piece], pieces: Iterable[Piece]) -> list[Piece]:
    """Append `pieces` to `merged` in place, joining each to its neighbour where they are
    one thing: text of the same kind, or argument fragments of the same call. Empty text
    is dropped. Returns `merged`.

    Only the last piece of `merged` is ever touched, so appending a stream delta by delta
    costs the size of each delta and of the last piece (a whole choice: merge_pieces).
    """
    for piece in pieces:
        if isinstance(piece, Text) and not piece.text:
            continue
        if merged and _joins(merged[-1], piece):
            merged[-1] = _with_text(piece, _text(merged[-1]) + _text(piece))
        else:
            merged.append(piece)
    return merged


def merge_pieces(pieces: Iterable[Piece]) -> list[Piece]:
    """`pieces` with neighbours joined as `extend_merged` does, in time linear in their
    text: a run's parts are joined once when it ends (extend_merged copies the run so far
    per piece, which is quadratic over a whole choice; it is for appending deltas)."""
    merged: list[Piece] = []
    parts: list[str] = []  # the texts / fragments of merged[-1]'s run
    for piece in pieces:
        if isinstance(piece, Text) and not piece.text:
            continue
        if merged and _joins(merged[-1], piece):
            parts.append(_text(piece))
            continue
        if len(parts) > 1:
            merged[-1] = _with_text(merged[-1], "".join(parts))
        merged.append(piece)
        parts = [_text(piece)]
    if len(parts) > 1:
        merged[-1] = _with_text(merged[-1], "".join(parts))
    return merged


def _joins(last: Piece, piece: Piece) -> bool:
    """Whether `piece` continues `last`: text of its kind, or arguments of its call."""
    if isinstance(piece, Text):
        return isinstance(last, Text) and last.kind == piece.kind
    if isinstance(piece, ToolCallArgs):
        return isinstance(last, ToolCallArgs) and last.index == piece.index
    return False


def _text(piece: Piece) -> str:
    """What joins in a run: a Text's text, a ToolCallArgs' fragment ("" for a start)."""
    if isinstance(piece, Text):
        return piece.text
    return piece.fragment if isinstance(piece, ToolCallArgs) else ""


def _with_text(piece: Piece, text: str) -> Piece:
    """`piece` (Text or ToolCallArgs) with `text` as its text or fragment."""
    if isinstance(piece, Text):
        return Text(piece.kind, text)
    assert isinstance(piece, ToolCallArgs)
    return ToolCallArgs(piece.index, text)


def text_of(pieces: Iterable[Piece], kind: TextKind) -> str:
    """All text of one kind, in order."""
    return "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == kind)
