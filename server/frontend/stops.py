"""Stop strings over streamed text, plus the hold-back helper the streaming parsers share.

A stop string may arrive split over any number of pushes, so the matcher holds back every
suffix that could still grow into one. That way a stop string is never emitted, not even
partly, and the text emitted is the same however the stream was chunked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def partial_match_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`.

    Streaming parsers hold that suffix back: the next chunk may complete the marker.
    Called per token and usually 0, so only the suffixes that start with a marker's first
    character are tried (str.find), longest first, not every length.
    """
    best, size = 0, len(text)
    for marker in markers:
        length = min(size, len(marker) - 1)  # the longest suffix that could match
        if length <= best:
            continue
        start = text.find(marker[0], size - length)
        while start >= 0 and size - start > best:
            if marker.startswith(text[start:]):
                best = size - start
                break
            start = text.find(marker[0], start + 1)
    return best


def find_first(text: str, markers: Iterable[str]) -> tuple[int, str] | None:
    """The earliest (start, marker) of any of `markers` in `text`; the longest wins a tie."""
    best: tuple[int, str] | None = None
    for marker in markers:
        start = text.find(marker)
        if start < 0:
            continue
        if best is None or (start, -len(marker)) < (best[0], -len(best[1])):
            best = (start, marker)
    return best


class StopStringMatcher:
    """Cuts a text stream at the first stop string; the stop string itself is never emitted.

    "First" means the stop string that is complete earliest in the stream (on a tie, the
    longest). This is what a token-by-token check would find, so the result does not
    depend on how the text was chunked: with stops ["abcd", "bc"], "abcd" stops after "a".
    """

    def __init__(self, stops: Sequence[str]) -> None:
        # Empty strings would match everywhere; duplicates only cost time.
        self._stops = tuple(dict.fromkeys(stop for stop in stops if stop))
        self._held = ""
        self.is_stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit).

        After a hit the emitted text ends just before the stop string and every later
        push returns ("", True).
        """
        if self.is_stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        found = self._first_stop(buffer)
        if found is not None:
            cut, self.matched = found
            self._held = ""
            self.is_stopped = True
            return buffer[:cut], True
        num_held = partial_match_len(buffer, self._stops)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], False

    def flush(self) -> str:
        """The held-back text at the end of the stream (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that completes earliest in `buffer`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # The first occurrence of a stop string is also the one that ends first.
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])
