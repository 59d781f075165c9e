"""/v1/responses on the real engine (tiny checkpoint) through the official `openai` SDK:
greedy output equals the chat route's for the same conversation, streaming equals
non-streaming, forced tool calls and a function_call_output round trip, text.format
json_schema enforced, previous_response_id continues (input_items, usage, prefix cache),
GET / DELETE by id, and bad input as OpenAI errors."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from fake_engine import LiveServer, served_checkpoint

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.server.frontend.tokenizer import TextTokenizer

MODEL = "tiny"
CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_prefill_chunk=128)
NO_THINKING = {"effort": "none"}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": SCHEMA,
    "strict": True,
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[AsyncEngine, TextTokenizer, LiveServer]]:
    with served_checkpoint("tiny", CONFIG, MODEL) as parts:
        yield parts


@pytest.fixture(scope="module")
def engine(served: tuple[AsyncEngine, TextTokenizer, LiveServer]) -> AsyncEngine:
    return served[0]


@pytest.fixture(scope="module")
def tokenizer(served: tuple[AsyncEngine, TextTokenizer, LiveServer]) -> TextTokenizer:
    return served[1]


@pytest.fixture(scope="module")
def client(served: tuple[AsyncEngine, TextTokenizer, LiveServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[2].url}/v1", api_key="unused", max_retries=0)


def test_greedy_response_equals_chat_and_stream(client: openai.OpenAI) -> None:
    """Greedy, thinking off: output_text equals the chat route's content for the same
    conversation; the stream's events come in the spec's order, its deltas join to the
    same text, and it ends incomplete (max_output_tokens) like the plain response."""
    kwargs = {"model": MODEL, "max_output_tokens": 16, "reasoning": NO_THINKING, **GREEDY}
    response = client.responses.create(input="Say hello", instructions="Be brief.", **kwargs)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=16, reasoning_effort="none", temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Say hello"}],
    )  # fmt: skip
    assert response.output_text and response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 16
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(input="Say hello", instructions="Be brief.",
                                          stream=True, **kwargs))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == response.output_text


def test_json_schema_format_is_enforced_and_streams_to_completed(client: openai.OpenAI) -> None:
    """text.format json_schema at temperature 1 on random weights: the answer parses and
    validates, status completed; streamed, the deltas join to such a document and the
    stream ends with response.completed."""
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    kwargs = {
        "model": MODEL, "input": "Weather as JSON", "reasoning": NO_THINKING,
        "max_output_tokens": 64, "temperature": 1.0, "text": {"format": fmt},
        "extra_body": {"seed": 3},
    }  # fmt: skip
    response = client.responses.create(**kwargs)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(deltas), SCHEMA)
    assert deltas == events[-1].response.output_text


def test_forced_tool_call_and_output_round_trip(client: openai.OpenAI) -> None:
    """tool_choice naming a function forces a function_call item with valid arguments
    (streamed as function_call_arguments deltas); its output sent back through
    previous_response_id renders and runs, with the call in the input items."""
    kwargs = {"model": MODEL, "tools": [WEATHER], "reasoning": NO_THINKING}
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(input="Weather in Oslo?", tool_choice=forced,
                                    max_output_tokens=96, **kwargs)  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    events = list(client.responses.create(input="Weather in Oslo?", tool_choice=forced,
                                          max_output_tokens=96, stream=True, **kwargs))  # fmt: skip
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas and done[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(input=[result], previous_response_id=first.id,
                                     max_output_tokens=16, **kwargs, **GREEDY)  # fmt: skip
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == call.call_id == items[2].call_id


def test_previous_response_id_continues_from_the_cache(
    client: openai.OpenAI, tokenizer: TextTokenizer
) -> None:
    """A continuation's prompt holds the first turn: its input items list it, and its
    history comes back from the prefix cache (usage.input_tokens_details.cached_tokens)."""
    user = "Tell me about caching. " * 150
    kwargs = {"model": MODEL, "max_output_tokens": 16, "reasoning": NO_THINKING, **GREEDY}
    first = client.responses.create(input=user, **kwargs)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **kwargs)
    history = len(
        tokenizer.encode(
            tokenizer.render_chat_text([{"role": "user", "content": user}], None, None, False)
        )
    )
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == history > 600
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id).data  # newest first
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"),
    ]  # fmt: skip
    assert items[1].content[0].text == first.output_text
    assert items[0].content[0].text == "And then?"


def test_retrieve_delete_and_errors(client: openai.OpenAI) -> None:
    """GET returns the stored response, DELETE forgets it; an unknown id, a bad item
    type and a schema the grammar cannot compile are OpenAI errors naming the field."""
    kwargs = {"model": MODEL, "max_output_tokens": 16, "reasoning": NO_THINKING}
    response = client.responses.create(input="Hi", **kwargs)
    assert client.responses.retrieve(response.id) == response
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(response.id)
    assert response.id in gone.value.body["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(input="Hi", previous_response_id="resp_nope", **kwargs)
    assert unknown.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as bad_item:
        client.responses.create(input=[{"type": "bogus"}], **kwargs)
    assert bad_item.value.body["param"] == "input" and "'bogus'" in bad_item.value.message
    fmt = {"type": "json_schema", "name": "b", "schema": {"type": "nope"}}
    with pytest.raises(openai.BadRequestError) as bad_schema:
        client.responses.create(input="Hi", text={"format": fmt}, **kwargs)
    assert bad_schema.value.body["param"] == "text.format"
