"""Streaming text parsers of server/frontend: stop strings, reasoning split, tool calls.

No tokenizer needed. The central property: every parser gives the same final result
however its input is chunked (whole, character by character, random pieces, a tag cut at
every position), and what it emits while streaming is always a prefix of that result.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator

import pytest

from deltaserve.server.frontend.pieces import (
    Piece,
    Text,
    ToolCallArgs,
    extend_merged,
    merge_pieces,
)
from deltaserve.server.frontend.reasoning import Delta, ReasoningParser
from deltaserve.server.frontend.stops import StopStringMatcher, partial_match_len
from deltaserve.server.frontend.tool_schema import declared_types, typed_value
from deltaserve.server.frontend.tools import (
    ToolCallCollector,
    ToolCallParser,
    ToolCallStart,
    parse_tool_calls,
)


def chunkings(text: str, seeds: int = 12) -> Iterator[list[str]]:
    """Whole, character by character, and random chunkings of `text`."""
    yield [text]
    yield list(text)
    for seed in range(seeds):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def two_cuts(text: str) -> Iterator[list[str]]:
    """Every way to cut `text` into three pieces (so any tag is split at every position)."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


# --------------------------------------------------------------------------- stop strings


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Brute force: cut before the stop string that is complete earliest (longest on a tie)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            return text[: end - max(len(s) for s in ending)], True
    return text, False


def run_stops(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher, emitted, hit = StopStringMatcher(stops), "", False
    expected, _ = reference_stop("".join(pieces), stops)
    for piece in pieces:
        text, hit = matcher.push(piece)
        emitted += text
        assert expected.startswith(emitted), "emitted text that is not in the final result"
    return emitted + matcher.flush(), hit


STOP_CASES = [
    ("The answer is 42. END of it", ["END"]),
    ("The answer is 42. END of it", ["of", "42"]),
    ("xxabcyy", ["ab", "abc"]),  # a stop that is a prefix of another
    ("xxabcyy", ["abc", "ab"]),
    ("abcd", ["abcd", "bc"]),  # "bc" completes first
    ("aaab", ["aab"]),  # overlapping partial matches
    ("no stop here at all", ["STOP", "halt"]),
    ("ends with a partial sto", ["stop"]),
    ("emoji 🎉 stop 你好", ["🎉 s", "你"]),
    ("plain", []),
]


@pytest.mark.parametrize(("text", "stops"), STOP_CASES)
def test_stop_result_is_the_same_for_every_chunking(text: str, stops: list[str]) -> None:
    """Text up to (not including) the earliest stop, whatever the chunking."""
    expected = reference_stop(text, stops)
    for pieces in [*chunkings(text), *two_cuts(text)]:
        assert run_stops(stops, pieces) == expected, pieces


def test_stop_holds_back_partial_match_and_flushes_it() -> None:
    """A suffix that may become a stop string waits; at the end it is released."""
    matcher = StopStringMatcher(["world"])
    assert matcher.push("hello wor") == ("hello ", False)
    assert matcher.flush() == "wor"


def test_stop_after_hit_everything_is_swallowed() -> None:
    """Once stopped, later text is never emitted."""
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.push("one\n\ntwo") == ("one", True)
    assert matcher.push("three") == ("", True)
    assert matcher.flush() == ""


def test_partial_match_len() -> None:
    """Longest suffix that is a proper prefix of a marker."""
    assert partial_match_len("abc<thi", ["<think>"]) == 4
    assert partial_match_len("abc<think>", ["<think>"]) == 0  # complete: not partial
    assert partial_match_len("aa", ["aab", "ab"]) == 2


# --------------------------------------------------------------------------- reasoning


def run_reasoning(starts_in_reasoning: bool, pieces: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(starts_in_reasoning)
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += parser.push(piece)
    deltas += parser.flush()
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    return reasoning, content


REASONING_CASES = [
    (
        True,
        "Let me think.\nStep 2.\n</think>\n\nThe answer.",
        "Let me think.\nStep 2.",
        "The answer.",
    ),
    (False, "<think>\nHmm.\n</think>\n\nHi!", "Hmm.", "Hi!"),
    (False, "\n<think>\nHmm.\n</think>\n\nHi!", "Hmm.", "Hi!"),  # whitespace before the tag
    (False, "Just content, <think> later is text.", "", "Just content, <think> later is text."),
    (True, "never closed <thi", "never closed <thi", ""),
    (True, "\n</think>\n\nNo thoughts.", "", "No thoughts."),
    (False, "Hi there", "", "Hi there"),
    (False, "<thinking> is not the tag", "", "<thinking> is not the tag"),
    (True, "a</think>b</think>c", "a", "b</think>c"),  # only the first close counts
    (True, "x\n\n</think>\n\n\ny", "x\n", "\ny"),  # exactly one "\n" / "\n\n" is markup
]


@pytest.mark.parametrize(("inside", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_is_the_same_for_every_chunking(
    inside: bool, text: str, reasoning: str, content: str
) -> None:
    """Tags split anywhere (every pair of cut points) give the same split; tags never leak."""
    for pieces in [*chunkings(text), *two_cuts(text)]:
        assert run_reasoning(inside, pieces) == (reasoning, content), pieces


def test_reasoning_streams_before_the_close_tag() -> None:
    """Reasoning text is emitted as it arrives, not at the end."""
    parser = ReasoningParser(starts_in_reasoning=True)
    assert parser.push("step one, ") == [Delta("reasoning", "step one, ")]
    assert parser.push("step two</th") == [Delta("reasoning", "step two")]
    assert parser.in_reasoning
    assert parser.push("ink>\n\nDone") == [Delta("content", "Done")]


# --------------------------------------------------------------------------- tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "hourly": {"type": "boolean"},
                "ratio": {"type": ["number", "null"]},
                "options": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "unit": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        },
    },
}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "write_file"}}]


def call_text(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


FULL_OUTPUT = (
    "Let me check both.\n\n"
    + call_text("get_weather", {"city": "Paris", "days": "3", "hourly": "true", "ratio": "0.5"})
    + "\n"
    + call_text(
        "get_weather",
        {
            "city": 'São Paulo "SP"',
            "options": '{"a": [1, 2]}',
            "tags": '["x", "y"]',
            "unit": "null",
        },
    )  # fmt: skip
    + "\n"
    + call_text("write_file", {"path": "a.py", "content": 'def f():\n    return "\\n"\n'})
    + "\n"
)
EXPECTED_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "hourly": True, "ratio": 0.5}),
    (
        "get_weather",
        {"city": 'São Paulo "SP"', "options": {"a": [1, 2]}, "tags": ["x", "y"], "unit": "null"},
    ),  # fmt: skip
    ("write_file", {"path": "a.py", "content": 'def f():\n    return "\\n"\n'}),
]
MARKUP = re.compile(r"</?(tool_call|function|parameter)")


def run_tools(tools: list[dict] | None, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser, collector = ToolCallParser(tools), ToolCallCollector()
    for piece in pieces:
        collector.add(parser.push(piece))
        assert not MARKUP.search(collector.content), "tool-call markup leaked into content"
    collector.add(parser.flush())
    calls = [(c.name, json.loads(c.arguments)) for c in collector.calls()]
    return collector.content, calls


def test_tool_calls_parse_typed_and_identical_for_every_chunking() -> None:
    """Three calls in a row, values typed by schema; same result for every chunking."""
    for pieces in chunkings(FULL_OUTPUT, seeds=30):
        assert run_tools(TOOLS, pieces) == ("Let me check both.", EXPECTED_CALLS), pieces


def test_tool_call_tags_split_at_every_position() -> None:
    """One call, cut at every pair of positions: same content and calls."""
    text = "Sure." + call_text("get_weather", {"city": "Rome", "days": "2"}) + " Done."
    # Whitespace around a call block is markup; the text on both sides is kept.
    expected = ("Sure.Done.", [("get_weather", {"city": "Rome", "days": 2})])
    for pieces in two_cuts(text):
        assert run_tools(TOOLS, pieces) == expected, pieces


def test_tool_call_ids_indices_and_streamed_string_values() -> None:
    """Starts carry index and call_<24 hex>; string values stream before the tag closes."""
    parser = ToolCallParser(TOOLS)
    deltas = parser.push(FULL_OUTPUT[: FULL_OUTPUT.index("Paris") + 3])
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather")]
    assert re.fullmatch(r"call_[0-9a-f]{24}", starts[0].id)
    assert deltas[-1].fragment.endswith('{"city": "Par')
    deltas += parser.push(FULL_OUTPUT[FULL_OUTPUT.index("Paris") + 3 :]) + parser.flush()
    ids = [d.id for d in deltas if isinstance(d, ToolCallStart)]
    assert len(set(ids)) == 3 and parser.num_calls == 3


def test_parse_tool_calls_matches_streaming() -> None:
    """The non-streaming helper gives the streaming result."""
    content, calls = parse_tool_calls(FULL_OUTPUT, TOOLS)
    assert content == "Let me check both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED_CALLS


def test_truncated_calls_always_give_valid_json_arguments() -> None:
    """Cut anywhere (max_tokens): every started call's arguments are a JSON object."""
    for end in range(len(FULL_OUTPUT) + 1):
        content, calls = parse_tool_calls(FULL_OUTPUT[:end], TOOLS)
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict), FULL_OUTPUT[:end]
        # Markup may reach content only as the unfinished tail of a cut-off call opening.
        match = MARKUP.search(content)
        assert match is None or FULL_OUTPUT[:end].endswith(content[match.start() :])


@pytest.mark.parametrize(
    "text",
    [
        "Use <tool_callx> or <tool_ca",
        "a <tool_call>just text</tool_call> b",
        "x <tool_call> {not xml} y",
        "<function=f> outside a call",
        "1 < 2 and <tool",
    ],
)
def test_text_that_only_looks_like_a_tool_call_is_content(text: str) -> None:
    """Fake or malformed markup is given back verbatim as content, for any chunking."""
    for pieces in [*chunkings(text), *two_cuts(text)]:
        parser, collector = ToolCallParser(None), ToolCallCollector()
        for piece in pieces:
            collector.add(parser.push(piece))
        collector.add(parser.flush())
        assert (collector.content, collector.calls()) == (text, [])


def test_unclosed_parameter_and_function_tags_are_tolerated() -> None:
    """A missing </parameter> or </function> still ends the value / call."""
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</tool_call>"
    content, calls = parse_tool_calls(text, None)
    assert content == "" and json.loads(calls[0].arguments) == {"a": "1", "b": "x"}


def test_no_parameters_gives_empty_object() -> None:
    """A call without parameters has arguments "{}"."""
    _, calls = parse_tool_calls(call_text("ping", {}), None)
    assert [(c.name, c.arguments) for c in calls] == [("ping", "{}")]


def test_string_values_keep_inner_newlines_and_strip_one_outer() -> None:
    """Only the single newline after the open tag and before the close tag is markup."""
    _, calls = parse_tool_calls(call_text("f", {"s": "\nline1\n\nline2\n"}), None)
    assert json.loads(calls[0].arguments) == {"s": "\nline1\n\nline2\n"}


def test_typed_value_falls_back_to_text() -> None:
    """Unparseable typed values stay strings; NaN is not let into JSON."""
    assert typed_value("3", frozenset({"integer"})) == 3
    assert typed_value("three", frozenset({"integer"})) == "three"
    assert typed_value("NaN", frozenset({"number"})) == "NaN"
    assert typed_value("True", frozenset({"boolean"})) is True
    assert typed_value("None", frozenset({"object", "null"})) is None


def test_declared_types() -> None:
    """type / type list / anyOf / enum are all understood; nothing declared = unknown."""
    assert declared_types({"type": "integer"}) == {"integer"}
    assert declared_types({"type": ["string", "null"]}) == {"string", "null"}
    assert declared_types({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {"integer", "null"}
    assert declared_types({"enum": [1, 2]}) == {"any"}
    assert declared_types({"enum": ["a", 1]}) == {"string"}
    assert declared_types({"description": "x"}) == frozenset()


def test_merge_pieces_joins_as_extend_merged_does() -> None:
    """merge_pieces (linear, for whole choices) gives what appending piece by piece with
    extend_merged gives, on random runs of text, empty text, call starts and arguments."""
    rng = random.Random(0)
    kinds: list[Piece] = [
        Text("content", ""), Text("content", "a"), Text("content", "bc"),
        Text("reasoning", ""), Text("reasoning", "x"), ToolCallStart(0, "c0", "f"),
        ToolCallStart(1, "c1", "g"), ToolCallArgs(0, ""), ToolCallArgs(0, "{"),
        ToolCallArgs(1, "1}"),
    ]  # fmt: skip
    for _ in range(5000):
        pieces = [rng.choice(kinds) for _ in range(rng.randrange(10))]
        merged: list[Piece] = []
        for piece in pieces:
            extend_merged(merged, [piece])
        assert merge_pieces(pieces) == merged, pieces


def test_partial_match_len_is_the_longest_held_suffix() -> None:
    """Against the definition, tried on every suffix length, over random small alphabets."""
    rng = random.Random(1)
    for _ in range(20000):
        text = "".join(rng.choice("ab<") for _ in range(rng.randrange(8)))
        markers = ["".join(rng.choice("ab<") for _ in range(rng.randrange(6))) for _ in "xyz"]
        expected = max(
            [
                n
                for m in markers
                for n in range(1, len(m))
                if n <= len(text) and text.endswith(m[:n])
            ],
            default=0,
        )
        assert partial_match_len(text, markers) == expected, (text, markers)
