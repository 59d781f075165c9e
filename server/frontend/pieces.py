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
    costs the size of each delta, not of everything so far.
    """
    for piece in pieces:
        last = merged[-1] if merged else None
        if isinstance(piece, Text):
            if not piece.text:
                continue
            if isinstance(last, Text) and last.kind == piece.kind:
                merged[-1] = Text(piece.kind, last.text + piece.text)
                continue
        elif (
            isinstance(piece, ToolCallArgs)
            and isinstance(last, ToolCallArgs)
            and last.index == piece.index
        ):
            merged[-1] = ToolCallArgs(piece.index, last.fragment + piece.fragment)
            continue
        merged.append(piece)
    return merged


def merge_pieces(pieces: Iterable[Piece]) -> list[Piece]:
    """`pieces` with neighbours joined as `extend_merged` does, in time linear in their
    text: a run's parts are joined once when it ends (extend_merged copies the run so far
    per piece, which is quadratic over a whole choice; it is for appending deltas)."""
    merged: list[Piece] = []
    parts: list[str] = []  # the texts / fragments of merged[-1], while it is a run
    for piece in pieces:
        last = merged[-1] if merged else None
        if isinstance(piece, Text):
            if not piece.text:
                continue
            if isinstance(last, Text) and last.kind == piece.kind:
                parts.append(piece.text)
                continue
        elif (
            isinstance(piece, ToolCallArgs)
            and isinstance(last, ToolCallArgs)
            and last.index == piece.index
        ):
            parts.append(piece.fragment)
            continue
        _join_run(merged, parts)
        merged.append(piece)
        parts = [piece.text] if isinstance(piece, Text) else []
        if isinstance(piece, ToolCallArgs):
            parts = [piece.fragment]
    _join_run(merged, parts)
    return merged


def _join_run(merged: list[Piece], parts: list[str]) -> None:
    """Replace merged[-1] by its run joined, when the run has more than one part."""
    if len(parts) < 2:
        return
    last = merged[-1]
    if isinstance(last, Text):
        merged[-1] = Text(last.kind, "".join(parts))
    elif isinstance(last, ToolCallArgs):
        merged[-1] = ToolCallArgs(last.index, "".join(parts))


def text_of(pieces: Iterable[Piece], kind: TextKind) -> str:
    """All text of one kind, in order."""
    return "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == kind)
