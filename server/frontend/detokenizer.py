"""Incremental detokenization: token ids in, newly completed text out.

Byte-level BPE tokens are byte strings, so one character (an emoji, a CJK ideograph)
can span several tokens, and decoding a prefix of them yields U+FFFD. We hold such text
back until the character completes. Each push decodes only a short window (the tokens
of the previous emission and the new ones), so the cost is O(new tokens), not O(all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, so at most 4 byte-level tokens can hold an
# incomplete one; if holding that many does not help, the U+FFFD is real.
MAX_CHAR_TOKENS = 4


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for one completion.

    The window scheme (as in vLLM/TGI): the window starts with the tokens of the last
    emission (the prefix); decoding the window and removing the prefix's text gives the
    new text. That context lets decoders that treat a first token specially (leading-space
    rules) produce the right text. Each token is decoded a bounded number of times.
    """

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self._tokenizer = tokenizer
        # Only the window is kept: ids[:read_offset] were emitted (the prefix, context for
        # the decoder), ids[read_offset:] are pending.
        self._token_ids: list[int] = []
        self._read_offset = 0
        self.num_tokens = 0  # token ids pushed so far

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated token ids; return the text they complete (maybe "")."""
        self._token_ids.extend(token_ids)
        self.num_tokens += len(token_ids)
        num_pending = len(self._token_ids) - self._read_offset
        if num_pending == 0:
            return ""
        prefix_text, full_text = self._decode_window()
        if not full_text.endswith(REPLACEMENT_CHAR):
            return self._advance(prefix_text, full_text, len(self._token_ids))
        # The last character is incomplete: emit up to the last token boundary before it
        # and hold the rest (at most MAX_CHAR_TOKENS tokens; holding all of them back
        # would delay a whole multi-token push).
        for num_held in range(1, min(MAX_CHAR_TOKENS, num_pending) + 1):
            end = len(self._token_ids) - num_held
            text = self._tokenizer.decode(self._token_ids[:end])
            if not text.endswith(REPLACEMENT_CHAR):
                return self._advance(prefix_text, text, end)
        # Not a character in progress but invalid bytes from the model: let U+FFFD out.
        return self._advance(prefix_text, full_text, len(self._token_ids))

    def flush(self) -> str:
        """End of stream: return any held-back text, incomplete characters as U+FFFD."""
        if len(self._token_ids) == self._read_offset:
            return ""
        return self._advance(*self._decode_window(), len(self._token_ids))

    def _decode_window(self) -> tuple[str, str]:
        ids = self._token_ids
        prefix_text = self._tokenizer.decode(ids[: self._read_offset])
        full_text = self._tokenizer.decode(ids)
        return prefix_text, full_text

    def _advance(self, prefix_text: str, full_text: str, read_end: int) -> str:
        """Emit `full_text` (the window decoded up to `read_end`) past the prefix."""
        # The window text normally starts with the prefix text; if a decoder rewrote the
        # joint (it should not for byte-level BPE), the tail past its length is still
        # the best estimate of what is new.
        new_text = full_text[len(prefix_text) :]
        if read_end > self._read_offset:
            # The tokens just emitted become the next prefix; older ones are not needed.
            del self._token_ids[: self._read_offset]
            self._read_offset = read_end - self._read_offset
        return new_text
