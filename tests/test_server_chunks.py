"""The streamed chunks that ChunkFrame builds without pydantic models are byte for byte
what the models (server/responses.py) serialize: chat.completion.chunk for content,
reasoning, tool-call deltas, logprobs and the finish chunk; text_completion chunks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deltaserve.server.frontend.choice import ChoiceDelta, LogprobEntry, TopLogprob
from deltaserve.server.frontend.pieces import Piece, Text, ToolCallArgs, ToolCallStart
from deltaserve.server.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallDelta,
    ToolCallDelta,
)
from deltaserve.server.routes_chat import ChatWriter, chat_logprobs
from deltaserve.server.routes_completions import CompletionWriter
from deltaserve.server.routes_generation import ChoiceEvent
from deltaserve.server.schemas import ChatCompletionRequest, CompletionRequest
from deltaserve.server.sse import ChunkFrame, sse_data

# Strings that JSON escapes differently across encoders: quotes, backslashes, control
# characters, DEL, non-ASCII (2-, 3- and 4-byte UTF-8), the JS line separators, HTML.
TEXTS = [
    " w1",
    'say "hi"\\ \n\t\r\b\f \x00 \x1f \x7f',
    "é 中文 😀 \u2028\u2029 </script> &<>'",
    "",
]
LOGPROBS = [
    LogprobEntry(" w", b" w", -0.25, (TopLogprob("é", b"\xc3", -3), TopLogprob("w", b"w", -0.5))),
    LogprobEntry("😀", b"\xf0\x9f", float("-inf"), ()),
    LogprobEntry("x", b"x", -1e-7, (TopLogprob("y", b"y", -1e22),)),
]  # fmt: skip
PIECES: list[list[Piece]] = [
    [Text("content", text)] for text in TEXTS if text
] + [
    [Text("reasoning", TEXTS[1])],
    [Text("reasoning", "think"), Text("content", TEXTS[2])],
    [ToolCallStart(0, "call_abc", "get_weather"), ToolCallArgs(0, '{"city": "Par')],
    [ToolCallArgs(0, 'is"}'), ToolCallStart(1, "call_def", "f"), ToolCallArgs(1, "{}")],
    [ToolCallArgs(1, "")],
    [Text("content", "a"), ToolCallStart(0, "call_x", "g")],
]  # fmt: skip
HEAD = {"id": "chatcmpl-0123", "created": 1700000000, "model": 'm "é"', "system_fingerprint": "fp"}

COMPLETION_HEAD = {**HEAD, "id": "cmpl-0123"}


def _chat_writer(logprobs: bool = False, parallel: bool = True) -> ChatWriter:
    body = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        logprobs=logprobs,
        parallel_tool_calls=parallel,
    )
    writer = ChatWriter("chatcmpl-0123", 'm "é"', "fp", body)
    writer.head_fields["created"] = HEAD["created"]
    writer._frame = ChunkFrame(ChatCompletionChunk(**writer.head_fields, choices=[]))
    return writer


def _chat_reference(event: ChoiceEvent, logprobs: bool, parallel: bool) -> list[bytes]:
    """What ChatWriter.event sent when it built the pydantic chunk models."""
    delta, out = event.delta, []
    calls = [
        ToolCallDelta(
            index=c.index,
            id=c.id,
            type="function" if c.id is not None else None,
            function=FunctionCallDelta(name=c.name, arguments=c.arguments),
        )
        for c in delta.tool_calls
        if parallel or c.index == 0
    ]
    if delta.content or delta.reasoning or calls or delta.logprobs:
        message = ChatDelta(
            content=delta.content or None,
            reasoning_content=delta.reasoning or None,
            tool_calls=calls or None,
        )
        lp = chat_logprobs(delta.logprobs) if logprobs else None
        choice = ChatChunkChoice(index=event.index, delta=message, logprobs=lp)
        out.append(sse_data(ChatCompletionChunk(**HEAD, choices=[choice])))
    if event.finish_reason is not None:
        last = ChatChunkChoice(
            index=event.index, delta=ChatDelta(), finish_reason=event.finish_reason
        )
        out.append(sse_data(ChatCompletionChunk(**HEAD, choices=[last])))
    return out


def _events() -> list[ChoiceEvent]:
    events = [ChoiceEvent(0, ChoiceDelta(pieces)) for pieces in PIECES]
    events += [
        ChoiceEvent(2, ChoiceDelta(PIECES[0], LOGPROBS)),
        ChoiceEvent(1, ChoiceDelta([], LOGPROBS[1:])),
    ]
    events += [
        ChoiceEvent(0, ChoiceDelta(PIECES[1]), "stop"),
        ChoiceEvent(3, ChoiceDelta(), "tool_calls"),
    ]
    return events  # fmt: skip


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_chat_chunks_match_the_pydantic_models(logprobs: bool, parallel: bool) -> None:
    writer = _chat_writer(logprobs, parallel)
    for event in _events():
        assert writer.event(event) == _chat_reference(event, logprobs, parallel), event


def test_completion_chunks_match_the_pydantic_models() -> None:
    state = SimpleNamespace(model_name='m "é"', fingerprint="fp")
    for logprobs in (None, 2):
        body = CompletionRequest(model="m", prompt="hi", stream=True, logprobs=logprobs)
        writer = CompletionWriter("cmpl-0123", state, body, ["", "echo ü\n"])  # type: ignore[arg-type]
        writer.head_fields["created"] = HEAD["created"]
        writer._frame = ChunkFrame(writer._object([]))
        reference = CompletionWriter("cmpl-0123", state, body, ["", "echo ü\n"])  # type: ignore[arg-type]

        def chunk(index: int, text: str, reason: str | None = None, **extra: object) -> bytes:
            choice = CompletionChoice(index=index, text=text, finish_reason=reason, **extra)  # type: ignore[arg-type]
            return sse_data(CompletionResponse(**COMPLETION_HEAD, choices=[choice]))

        assert writer.head(None) == [chunk(1, "echo ü\n")]  # type: ignore[arg-type]
        for event in _events():
            expected, text = [], event.delta.content
            if text or event.delta.logprobs:
                lp: CompletionLogprobs | None = reference._logprobs(
                    event.index % 2, event.delta.logprobs
                )
                expected.append(chunk(event.index % 2, text, logprobs=lp))
            if event.finish_reason is not None:
                expected.append(chunk(event.index % 2, "", event.finish_reason))
            event = ChoiceEvent(event.index % 2, event.delta, event.finish_reason)
            assert writer.event(event) == expected, event


def test_chunk_frame_needs_choices_last() -> None:
    from deltaserve.server.responses import Usage

    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    with pytest.raises(ValueError, match="choices"):
        ChunkFrame(ChatCompletionChunk(**HEAD, choices=[], usage=usage))
