"""/v1/responses without a model: Response objects and every stream event validate
against the OpenAI spec, the event sequence is the spec's, the input adapter renders the
conversation chat would, the store is bounded (count and bytes) and errors take OpenAI's
shape. Live uvicorn + FakeEngine (scripted output through the real Qwen3.5 tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, LiveServer, real_tokenizer, spec_errors
from image_samples import data_url, encoded, picture

from deltaserve.server.app import create_app
from deltaserve.server.errors import APIError
from deltaserve.server.frontend.responses_input import chat_messages, item_resources
from deltaserve.server.response_store import ResponseStore
from deltaserve.server.settings import ModelSettings, ResponseStoreSettings, Settings

MODEL = "qwen-test"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOL_CALL_SCRIPT = (
    "I should look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(real_tokenizer(), max_context=1024)


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    settings = Settings(
        model=ModelSettings(path="unused", served_name=MODEL),
        responses=ResponseStoreSettings(max_stored=3),
    )
    with LiveServer(create_app(engine, real_tokenizer(), settings)) as live:
        yield live


@pytest.fixture
def http(server: LiveServer, engine: FakeEngine) -> Iterator[httpx.Client]:
    engine.reset()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def assert_valid(schema: str, instance: Any) -> None:
    assert spec_errors(schema, instance) == [], json.dumps(instance)


def named_events(body: bytes) -> list[dict[str, Any]]:
    """The events of a Responses stream; each SSE event's name equals its type."""
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def create(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": MODEL, **body})


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": [WEATHER]},
        {"max_output_tokens": 16},
        {"instructions": "Be brief.", "metadata": {"k": "v"}, "store": False},
        {"text": {"format": {"type": "json_object"}}},
    ],
    ids=["thinking", "tool-call", "incomplete", "instructions", "json-object"],
)
def test_response_matches_spec(http: httpx.Client, engine: FakeEngine, extra: dict) -> None:
    """Non-streamed Response objects validate against the spec's Response; reasoning is
    its own item, a call a function_call item, a cut answer is status incomplete."""
    if "tools" in extra:
        engine.script = lambda request: TOOL_CALL_SCRIPT
    got = create(http, input="Hello", **extra)
    assert got.status_code == 200, got.text
    body = got.json()
    assert_valid("Response", body)
    kinds = [item["type"] for item in body["output"]]
    assert kinds[0] == "reasoning"
    if "tools" in extra:
        assert kinds == ["reasoning", "function_call"]
        assert json.loads(body["output"][1]["arguments"]) == {"city": "Paris"}
    elif "max_output_tokens" in extra:
        assert body["status"] == "incomplete"
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert kinds == ["reasoning", "message"] and body["status"] == "completed"
        assert body["output"][1]["content"][0]["text"] == "Hello! How can I help you today?"
    usage = body["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_stream_events_follow_the_spec(http: httpx.Client, engine: FakeEngine, tools: bool) -> None:
    """Every event validates as a ResponseStreamEvent, sequence numbers count up from 0,
    the order is created, in_progress, per item added ... done, completed, and the
    deltas join to the final items."""
    extra = {"tools": [WEATHER]} if tools else {}
    if tools:
        engine.script = lambda request: TOOL_CALL_SCRIPT
    got = create(http, input="Hello", stream=True, **extra)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
    events = named_events(got.content)
    for event in events:
        assert_valid("ResponseStreamEvent", event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    final = events[-1]["response"]
    last = "response.function_call_arguments" if tools else "response.output_text"
    assert f"{last}.delta" in kinds
    expected = ["response.output_item.added", "response.content_part.added"]
    expected += ["response.reasoning_text.delta", "response.reasoning_text.done"]
    expected += ["response.content_part.done", "response.output_item.done"]
    expected += ["response.output_item.added"]
    if tools:
        expected += [f"{last}.delta", f"{last}.done"]
    else:
        expected += ["response.content_part.added", f"{last}.delta", f"{last}.done"]
        expected += ["response.content_part.done"]
    expected += ["response.output_item.done"]
    assert list(dict.fromkeys(kinds[2:-1])) == list(dict.fromkeys(expected))
    deltas = "".join(e["delta"] for e in events if e["type"] == f"{last}.delta")
    if tools:
        assert deltas == final["output"][1]["arguments"]
    else:
        assert deltas == final["output"][1]["content"][0]["text"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    assert http.get(f"/v1/responses/{final['id']}").json() == final


def test_store_get_delete_and_input_items(http: httpx.Client, engine: FakeEngine) -> None:
    """A stored response comes back by id; a continuation's input_items list the first
    turn (input and output) before the new input; DELETE forgets it (then 404)."""
    first = create(http, input="Hello", instructions="Be brief.").json()
    second = create(http, input="And then?", previous_response_id=first["id"]).json()
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_ids))
    assert "Hello" in prompt and "Hello! How can I help" in prompt and "Be brief" not in prompt
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    listing = http.get(f"/v1/responses/{second['id']}/input_items", params={"order": "asc"})
    assert listing.status_code == 200
    body = listing.json()
    assert_valid("ResponseItemList", body)
    kinds = [(item["type"], item.get("role")) for item in body["data"]]
    assert kinds == [
        ("message", "user"),
        ("reasoning", None),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert body["data"][1:3] == first["output"]
    page = http.get(f"/v1/responses/{second['id']}/input_items", params={"limit": 1}).json()
    assert page["data"][0]["content"][0]["text"] == "And then?" and page["has_more"]
    assert http.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    gone = http.get(f"/v1/responses/{first['id']}")
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == f"Response with id '{first['id']}' not found."


def test_function_call_output_round_trip_renders_as_chat(
    http: httpx.Client, engine: FakeEngine
) -> None:
    """Items sent back by hand (the output, then a function_call_output) render the same
    prompt as the chat route's assistant tool_calls + tool message."""
    call = {
        "type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }  # fmt: skip
    items = [
        {"role": "user", "content": "Weather?"},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    assert create(http, input=items, tools=[WEATHER]).status_code == 200
    chat = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant", "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    got = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": chat, "tools": [chat_tool]}
    )
    assert got.status_code == 200
    responses_prompt, chat_prompt = (r.prompt_ids for r in engine.requests[-2:])
    assert responses_prompt == chat_prompt


def test_adapter_merges_assistant_items_into_one_turn() -> None:
    """reasoning + message + function_call items become one assistant message."""
    items = item_resources(
        [
            {"type": "message", "role": "user", "content": "Hi"},
            {"type": "reasoning", "summary": [], "content": [
                {"type": "reasoning_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "content": "Checking."},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]
    )  # fmt: skip
    messages, refs = chat_messages(items, "sys", [f"input[{i}]" for i in range(len(items))])
    assert refs == []
    assert messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant", "content": "Checking.", "reasoning_content": "think",
            "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": {}}}],
        },
    ]  # fmt: skip
    assert all(item["id"] and item["status"] == "completed" for item in items)


def test_store_is_bounded_by_count_and_bytes() -> None:
    """The least recently used response goes first, by count and by bytes; one larger
    than the byte bound is not kept; a missing id is a 404 naming it."""
    store = ResponseStore(max_stored=2, max_bytes=400)

    def put(rid: str, size: int = 10) -> bool:
        return store.put({"id": rid, "output": [], "pad": "x" * size}, [])

    assert put("a") and put("b")
    store.get("a")  # now b is the least recently used
    assert put("c")
    assert set(store._entries) == {"a", "c"}
    assert put("d", 350)  # with a or c it would be over 400 bytes
    assert set(store._entries) == {"d"} and store.num_bytes <= 400
    assert not put("e", 1000) and set(store._entries) == {"d"}
    with pytest.raises(APIError) as error:
        store.get("a", "previous_response_id")
    assert error.value.status == 404 and error.value.param == "previous_response_id"
    assert "'a'" in error.value.message


def test_store_evicts_beyond_max_stored(http: httpx.Client) -> None:
    """With max_stored=3, the fourth response evicts the first: continuing it is a 404
    naming the id in OpenAI's error shape."""
    ids = [create(http, input=f"Turn {i}").json()["id"] for i in range(4)]
    got = create(http, input="Again", previous_response_id=ids[0])
    assert got.status_code == 404
    error = got.json()["error"]
    assert error["param"] == "previous_response_id" and ids[0] in error["message"]
    assert error["type"] == "not_found_error"
    assert create(http, input="Again", previous_response_id=ids[3]).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": [{"type": "bogus"}]}, "input", "'bogus'"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools"),
        ({"input": "x", "max_output_tokens": 4}, "max_output_tokens", "16"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input", "type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format", "schema"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
            "JSON",
        ),
    ],
    ids=["item-type", "tool-type", "short", "part-type", "required", "format", "arguments"],
)
def test_bad_requests_are_400s_naming_the_field(
    http: httpx.Client, body: dict, param: str, words: str
) -> None:
    """Bad input is a 400 in OpenAI's error shape naming the field."""
    got = create(http, **body)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param) and words in error["message"], error


def test_input_image_renders_as_chat_image_url(http: httpx.Client, engine: FakeEngine) -> None:
    """An input_image part reaches the engine as chat's image_url part does (same prompt,
    same image); a bad one is a 400 naming the part."""
    url = data_url(encoded(picture(64, 64)))
    parts = [{"type": "input_text", "text": "Look"}, {"type": "input_image", "image_url": url}]
    assert create(http, input=[{"role": "user", "content": parts}]).status_code == 200
    chat_parts = [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": chat_parts}]}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    ours, theirs = engine.requests[-2:]
    assert ours.prompt_ids == theirs.prompt_ids and ours.images[0].digest == theirs.images[0].digest
    parts[1]["image_url"] = "data:image/png;base64,bm90IGFuIGltYWdl"
    bad = create(http, input=[{"role": "user", "content": parts}])
    assert (
        bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].content[1].image_url"
    )
