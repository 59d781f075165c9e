"""Response shapes against the OpenAI OpenAPI spec, SSE framing byte for byte, and the
official `openai` SDK end to end (chat, streaming, n > 1, tools round trip, completions).
Live uvicorn + FakeEngine (scripted output through the real Qwen3.5 tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import FakeEngine, LiveServer, parse_sse, real_tokenizer, spec_errors

from deltaserve.engine.types import GenerationRequest
from deltaserve.server.app import create_app
from deltaserve.server.settings import ModelSettings, Settings

MODEL = "qwen-test"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL_SCRIPT = (
    "I should look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call>"
)
ANSWER_SCRIPT = "The tool said sunny.\n</think>\n\nIt is sunny in Paris."


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(real_tokenizer(), max_context=1024)


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    settings = Settings(model=ModelSettings(path="unused", served_name=MODEL))
    with LiveServer(create_app(engine, real_tokenizer(), settings)) as live:
        yield live


@pytest.fixture
def http(server: LiveServer, engine: FakeEngine) -> Iterator[httpx.Client]:
    engine.reset()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture
def sdk(server: LiveServer, engine: FakeEngine) -> openai.OpenAI:
    engine.reset()
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def tool_script(engine: FakeEngine) -> None:
    """Call get_weather when tools are offered; answer once the tool result is in."""

    def script(request: GenerationRequest) -> str:
        prompt = engine.tokenizer.decode(list(request.prompt_ids))
        return ANSWER_SCRIPT if "<tool_response>" in prompt else TOOL_CALL_SCRIPT

    engine.script = script


def assert_valid(schema: str, instance: Any) -> None:
    assert spec_errors(schema, instance) == [], json.dumps(instance)


def stream_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.content)
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"n": 2},
        {"logprobs": True, "top_logprobs": 3},
        {"tools": [WEATHER_TOOL]},
        {"max_tokens": 3},
        {"n": None, "stream": None, "stop": None, "tools": None, "temperature": None},
    ],
    ids=["plain", "n2", "logprobs", "tools", "length", "nulls-are-defaults"],
)
def test_chat_response_matches_spec(http: httpx.Client, engine: FakeEngine, extra: dict) -> None:
    """Non-streaming chat.completion objects validate against CreateChatCompletionResponse."""
    if "tools" in extra:
        tool_script(engine)
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **extra})
    assert response.status_code == 200, response.text
    body = response.json()
    assert_valid("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["logprobs"] is None or len(choice["logprobs"]["content"][0]["top_logprobs"]) == 3
    assert choice["message"]["refusal"] is None and body["system_fingerprint"].startswith("fp_")
    assert len(body["choices"]) == (extra.get("n") or 1)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"n": 2, "stream_options": {"include_usage": True}},
        {"logprobs": True, "top_logprobs": 2},
        {"tools": [WEATHER_TOOL]},
    ],
    ids=["plain", "n2-usage", "logprobs", "tools"],
)
def test_every_chat_chunk_matches_spec(http: httpx.Client, engine: FakeEngine, extra: dict) -> None:
    """Each chat.completion.chunk validates; role first, finish last, usage chunk last."""
    if "tools" in extra:
        tool_script(engine)
    body = {"model": MODEL, "messages": USER, "stream": True, **extra}
    chunks = stream_events(http, "/v1/chat/completions", body)
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
        assert chunk["object"] == "chat.completion.chunk"
    assert len({chunk["id"] for chunk in chunks}) == 1
    choice_chunks = [c for c in chunks if c["choices"]]
    for index in range(extra.get("n", 1)):
        mine = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] is not None
        assert all(c["finish_reason"] is None for c in mine[:-1])
    if extra.get("stream_options"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_completion_matches_spec(http: httpx.Client) -> None:
    """text_completion objects (list prompt, n=2, logprobs) validate; choices are numbered."""
    body = {
        "model": MODEL,
        "prompt": ["The capital", "Hello"],
        "n": 2,
        "logprobs": 2,
        "max_tokens": 4,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert_valid("CreateCompletionResponse", data)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["choices"][0]["logprobs"]["tokens"][0] == " Paris"


def test_completion_stream_matches_spec(http: httpx.Client) -> None:
    """Streamed completions use the same object; only intermediate finish_reason is null.

    The spec lists no null for finish_reason, yet OpenAI (and every client) sends null on
    chunks before the last; that one deviation is tolerated here.
    """
    body = {
        "model": MODEL,
        "prompt": "The capital",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = stream_events(http, "/v1/completions", body)
    for chunk in chunks:
        errors = spec_errors("CreateCompletionResponse", chunk)
        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
            errors = [e for e in errors if not e.startswith("choices/0/finish_reason")]
        assert errors == [], chunk
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == " Paris is the capital of France."
    assert chunks[-1]["usage"]["completion_tokens"] == 8  # 7 text tokens + EOS


def test_spec_validation_is_not_vacuous() -> None:
    """The validator resolves $refs and rejects wrong shapes (so passing means something)."""
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": None, "logprobs": None}],
    }
    assert spec_errors("CreateChatCompletionStreamResponse", chunk) == []
    assert spec_errors("CreateChatCompletionStreamResponse", {**chunk, "object": "chat"})
    bad_choice = {**chunk["choices"][0], "finish_reason": "done"}
    assert spec_errors("CreateChatCompletionStreamResponse", {**chunk, "choices": [bad_choice]})
    assert spec_errors("ErrorResponse", {"error": {"message": "m", "type": "t"}})
    assert spec_errors("CreateChatCompletionResponse", {"id": "x", "choices": []})


def test_models_and_error_match_spec(http: httpx.Client) -> None:
    """/v1/models is a ListModelsResponse; errors are ErrorResponses."""
    models = http.get("/v1/models").json()
    assert_valid("ListModelsResponse", models)
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert_valid("Model", http.get(f"/v1/models/{MODEL}").json())
    assert_valid("ErrorResponse", http.post("/v1/chat/completions", json={}).json())


def test_sse_framing_byte_for_byte(http: httpx.Client, engine: FakeEngine) -> None:
    """The exact bytes of a small stream: role, two deltas, finish, usage, [DONE]."""
    engine.script = lambda request: "Hi there"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    raw = http.post("/v1/chat/completions", json=body).content
    first = json.loads(raw.split(b"\n\n")[0].removeprefix(b"data: "))
    num_prompt = len(engine.requests[-1].prompt_ids)
    head = f'"id":"{first["id"]}","object":"chat.completion.chunk","created":{first["created"]},'
    head += f'"model":"{MODEL}","system_fingerprint":"{first["system_fingerprint"]}"'

    def choice(delta: str, finish: str = "null") -> bytes:
        choices = f'[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]'
        return f'data: {{{head},"choices":{choices}}}\n\n'.encode()

    total = num_prompt + 3  # "Hi", " there", EOS
    usage = (
        f'"usage":{{"prompt_tokens":{num_prompt},"completion_tokens":3,"total_tokens":{total},'
        '"prompt_tokens_details":{"cached_tokens":0}}'
    )
    expected = (
        choice('{"role":"assistant","content":""}')
        + choice('{"content":"Hi"}')
        + choice('{"content":" there"}')
        + choice("{}", '"stop"')
        + f'data: {{{head},"choices":[],{usage}}}\n\n'.encode()
        + b"data: [DONE]\n\n"
    )
    assert raw == expected


def test_sdk_chat(sdk: openai.OpenAI) -> None:
    """The openai SDK parses a chat completion, reasoning split from content."""
    completion = sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=50)
    message = completion.choices[0].message
    assert message.content == "Hello! How can I help you today?"
    assert message.model_extra["reasoning_content"] == "The user greets me."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens > 0


def test_sdk_chat_stream_n2(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    """Streaming with n=2 through the SDK: both choices complete; one engine request."""
    stream = sdk.chat.completions.create(model=MODEL, messages=USER, n=2, stream=True)
    texts = ["", ""]
    finish = [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == ["Hello! How can I help you today?"] * 2 and finish == ["stop", "stop"]
    assert len(engine.requests) == 1 and engine.requests[0].n == 2


def test_sdk_tools_round_trip(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    """Tool call out (typed JSON args), tool result back in, final answer."""
    tool_script(engine)
    first = sdk.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    history = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    second = sdk.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "It is sunny in Paris."
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_ids))
    assert "<function=get_weather>" in prompt and '{"sky": "sunny"}' in prompt


def test_sdk_tools_stream(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    """Streamed tool-call deltas accumulate to the same call."""
    tool_script(engine)
    stream = sdk.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER_TOOL], stream=True
    )
    name, arguments, finish = None, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            name = call.function.name or name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris", "days": 2}
    assert finish == "tool_calls"


def test_sdk_completions(sdk: openai.OpenAI) -> None:
    """Legacy completions through the SDK, non-streaming and streaming, with echo."""
    done = sdk.completions.create(model=MODEL, prompt="The capital", max_tokens=3, echo=True)
    assert done.choices[0].text == "The capital Paris is the"
    assert done.choices[0].finish_reason == "length"
    parts = sdk.completions.create(model=MODEL, prompt="The capital", stream=True)
    assert "".join(c.choices[0].text for c in parts) == " Paris is the capital of France."
    assert [m.id for m in sdk.models.list()] == [MODEL]
