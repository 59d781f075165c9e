"""The model's tokenizer and chat template, behind a small text-in/ids-out interface.

Loaded once per server from the model directory with transformers (a fast, tokenizers
backed tokenizer). Everything the frontend needs goes through `TextTokenizer`, so the
rest of the server never touches transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken
from transformers import AutoTokenizer

from deltaserve.models.chat_format import (
    IM_START,
    IMAGE_PAD,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)
from deltaserve.server.frontend.grammar import reasoning_end_id
from deltaserve.server.frontend.messages import PromptError, normalize_messages, normalize_tools

# Added tokens the parsers read in the decoded text; never hidden, even if a tokenizer
# marks them special.
MARKUP_TOKENS = frozenset({THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE})
# Arguments of apply_chat_template that request kwargs must not override.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
     "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
     "max_length", "sanitize_control_tokens"}
)  # fmt: skip


class TextTokenizer:
    """Encode/decode text and render chat prompts for one model directory."""

    def __init__(self, model_dir: str | Path, eos_token_ids: Sequence[int]) -> None:
        """eos_token_ids: the ids that end generation, as the engine resolved them from
        the checkpoint (hidden from output text)."""
        self.model_dir = Path(model_dir)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # The raw `tokenizers` object: faster than the wrapper, and safe to share between
        # threads (render_chat runs in a thread pool).
        self._backend = getattr(self._tokenizer, "backend_tokenizer", None)
        self.eos_token_ids = tuple(eos_token_ids)
        added = self._tokenizer.added_tokens_decoder
        specials = {i for i, token in added.items() if token.special}
        specials |= set(self._tokenizer.all_special_ids)
        markup = {i for i, token in added.items() if str(token) in MARKUP_TOKENS}
        # Special tokens that must not show up in output text (EOS, <|im_start|>, …).
        self.hidden_token_ids: frozenset[int] = frozenset(
            (specials - markup) | set(self.eos_token_ids)
        )
        self._added_text = {i: str(token) for i, token in added.items()}
        # Added tokens matched in the raw text, before normalization and BPE: a text splits
        # into independent pieces where one starts (see _splits_at_added_token).
        raw = [token for token in added.values() if not token.normalized]
        self._raw_added = tuple({token.content for token in raw})
        self._seam_tokens = frozenset(token.content for token in raw if _can_start_a_piece(token))
        # None: the model takes no images. (The template writes one pad per image; the
        # prompt repeats it for each of the image's tokens: expand_images.)
        self.image_pad_id: int | None = {text: i for i, text in self._added_text.items()}.get(
            IMAGE_PAD
        )
        self._byte_of_char = _byte_level_decoder()
        self._token_text_cache: dict[int, str] = {}
        # `</think>` (one added token in Qwen3.5; None: the model cannot think) and the
        # tokens a thinking budget forces, the close as the template writes it.
        self.think_end_id: int | None = reasoning_end_id(self.encode)
        close = tuple(self.encode(f"\n{THINK_CLOSE}\n\n"))
        self.thinking_close_ids: tuple[int, ...] = close if self.think_end_id in close else ()

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS or other special tokens are added."""
        if self._backend is not None:
            # Straight to the Rust tokenizer: transformers' wrapper may reconfigure
            # truncation/padding on it, which is unsafe from several threads at once. A
            # batch of one: tokenizers' encode_batch releases the GIL while Rust works and
            # its encode does not, and the engine thread shares this interpreter
            # (bench/tokenizer_gil.py, this 2-core box: a Python thread beside 4,000-word
            # encodes ran at 0.30 of its speed alone, 0.88 beside encode_batch, 0.92
            # beside a GIL-free sleep).
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens included (callers filter them first)."""
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=False)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text as decoded alone (U+FFFD for a partial UTF-8 character)."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._token_text_cache[token_id] = self.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's exact bytes (for OpenAI logprobs' `bytes`)."""
        if token_id in self._added_text:
            return self._added_text[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(c in self._byte_of_char for c in piece):
            return bytes(self._byte_of_char[c] for c in piece)
        return self.token_text(token_id).encode()

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        image_tokens: Sequence[int] | None = None,
    ) -> tuple[list[int], bool]:
        """Render OpenAI chat messages with the model's template and tokenize the prompt.

        image_tokens: the token count of each image_url part, in order (the loaded
        images' num_tokens); each image's one `<|image_pad|>` becomes that many. None =
        a text-only caller: image parts are refused.
        Returns (prompt ids, whether the prompt ends inside an opened `<think>` block, so
        the output starts in reasoning). Raises PromptError for input the template or
        this server cannot handle.
        """
        text, ids = self._render_prompt(messages, tools, chat_template_kwargs, image_tokens)
        return ids, ends_in_reasoning(text)

    def render_chat_with_history(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        image_tokens: Sequence[int] | None = None,
    ) -> tuple[list[int], bool, int]:
        """render_chat and history_length at once: (prompt ids, whether the output starts
        in reasoning, history length), the prompt rendered and tokenized only once."""
        text, ids = self._render_prompt(messages, tools, chat_template_kwargs, image_tokens)
        history = self._history_length(
            ids, text, messages, tools, chat_template_kwargs, image_tokens
        )
        return ids, ends_in_reasoning(text), history

    def history_length(
        self,
        prompt_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        image_tokens: Sequence[int] | None = None,
    ) -> int:
        """Tokens of `prompt_ids` (render_chat's) that render the messages alone, without
        the generation prompt: the next turn of this chat starts with them, so the prefix
        cache snapshots there (GenerationRequest.prefix_hint). 0 when the template does
        not render the history as a token prefix of the prompt."""
        allow_images = image_tokens is not None
        text = self.render_chat_text(messages, tools, chat_template_kwargs, True, allow_images)
        return self._history_length(
            prompt_ids, text, messages, tools, chat_template_kwargs, image_tokens
        )

    def _render_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        image_tokens: Sequence[int] | None,
    ) -> tuple[str, list[int]]:
        """The prompt text (with the generation prompt) and its ids, images expanded."""
        allow_images = image_tokens is not None
        text = self.render_chat_text(messages, tools, chat_template_kwargs, True, allow_images)
        ids = self.encode(text)
        if allow_images:
            ids = self.expand_images(ids, image_tokens or ())
        return text, ids

    def _history_length(
        self,
        prompt_ids: list[int],
        prompt_text: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        image_tokens: Sequence[int] | None,
    ) -> int:
        """history_length given the prompt's text: from the generation prompt's tokens
        alone where the seam is certain, else by tokenizing the whole history."""
        allow_images = image_tokens is not None
        history = self.render_chat_text(messages, tools, chat_template_kwargs, False, allow_images)
        length = self._history_by_suffix(prompt_ids, prompt_text, history)
        if length is None:
            length = self._history_by_encoding(prompt_ids, history, image_tokens)
        return length

    def _history_by_suffix(self, prompt_ids: list[int], prompt: str, history: str) -> int | None:
        """len(prompt_ids) less the tokens of what the prompt text adds to the history
        text, when the tokenizer certainly splits the prompt between the two (an added
        token starts the rest); None when it might not. With no image pads in the rest,
        every image is in the history, and its expansion in the prompt's prefix."""
        if self._backend is None or not prompt.startswith(history):
            return None
        rest = prompt[len(history) :]
        if not self._splits_at_added_token(history, rest):
            return None
        rest_ids = self.encode(rest)
        start = len(prompt_ids) - len(rest_ids)
        if start < 0 or prompt_ids[start:] != rest_ids or self.image_pad_id in rest_ids:
            return None
        return start

    def _history_by_encoding(
        self, prompt_ids: list[int], history: str, image_tokens: Sequence[int] | None
    ) -> int:
        """history_length by tokenizing the history text (the general method)."""
        ids = self.encode(history)
        if image_tokens is not None:
            try:  # every image is in the history: the generation prompt adds none
                ids = self.expand_images(ids, image_tokens)
            except PromptError:
                return 0
        return len(ids) if prompt_ids[: len(ids)] == ids else 0

    def _splits_at_added_token(self, left: str, right: str) -> bool:
        """Whether `left + right` tokenizes as `left` then `right`: the longest raw added
        token at the seam starts `right` and can start a piece there, and no added token
        straddles the seam (the tokenizer splits added tokens out first, leftmost first)."""
        at_seam = [token for token in self._raw_added if right.startswith(token)]
        if not at_seam or max(at_seam, key=len) not in self._seam_tokens:
            return False
        width = max(map(len, self._raw_added)) - 1
        tail = left[max(0, len(left) - width) :]
        window, seam = tail + right[:width], len(tail)
        return not any(
            window.find(token, max(0, seam - len(token) + 1), seam + len(token) - 1) >= 0
            for token in self._raw_added
        )

    def expand_images(self, ids: list[int], image_tokens: Sequence[int]) -> list[int]:
        """`ids` with the i-th `<|image_pad|>` repeated image_tokens[i] times."""
        pad = self.image_pad_id
        num_pads = ids.count(pad) if pad is not None else 0
        if image_tokens and pad is None:
            raise PromptError("this model does not take images")
        if num_pads != len(image_tokens):
            raise PromptError(
                f"the prompt has {num_pads} {IMAGE_PAD} tokens for {len(image_tokens)} "
                f"images; message text must not contain {IMAGE_PAD}"
            )
        if not image_tokens:
            return ids
        sizes = iter(image_tokens)
        out: list[int] = []
        for token in ids:
            if token == pad:
                out.extend([pad] * next(sizes))
            else:
                out.append(token)
        return out

    def render_chat_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        allow_images: bool = False,
    ) -> str:
        """The rendered prompt text (see render_chat); allow_images: user messages' image
        parts render as the template's image placeholder."""
        if not self._tokenizer.chat_template:
            raise PromptError("this model has no chat template; use /v1/completions")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise PromptError(
                f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs"
            )
        try:
            return self._tokenizer.apply_chat_template(
                normalize_messages(messages, allow_images),
                tools=normalize_tools(tools),
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except jinja2.TemplateError as error:
            # raise_exception() in the template (e.g. a misplaced system message).
            raise PromptError(f"chat template error: {error}") from None


def ends_in_reasoning(prompt: str) -> bool:
    """Whether the last turn of `prompt` opened `<think>` without closing it."""
    last_turn = prompt[prompt.rfind(IM_START) :] if IM_START in prompt else prompt
    return last_turn.rfind(THINK_OPEN) > last_turn.rfind(THINK_CLOSE)


def _can_start_a_piece(token: AddedToken) -> bool:
    """Whether an added token found right after other text is split out there exactly:
    it takes in no whitespace on its left, and its first character is neither
    whitespace (another token may take that in) nor a word character (a single-word
    token before it would then not match, as it does at the end of a text)."""
    first = token.content[:1]
    joins = first.isalnum() or first == "_" or first.isspace()
    return bool(first) and not (joins or token.lstrip or token.single_word)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character -> the byte it stands for."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if chr(b) not in table:
            table[chr(256 + extra)] = b
            extra += 1
    return table
