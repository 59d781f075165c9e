"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by the
official `anthropic` SDK and raw HTTP against a live uvicorn + FakeEngine: thinking and
text blocks, the stream's event order, tools round trip, stop reasons, usage, images,
errors in Anthropic's shape, x-api-key auth. The same conversation sent as an OpenAI chat
must reach the engine as the same prompt. The real engine (tiny checkpoint) is in
tests/test_server_messages_engine.py."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from fake_engine import FakeEngine, LiveServer, real_tokenizer
from PIL import Image

from deltaserve.engine.api import QueueFullError
from deltaserve.engine.types import GenerationRequest
from deltaserve.server.app import create_app
from deltaserve.server.settings import ModelSettings, ServerSettings, Settings

API_KEY = "test-key"
MODEL = "qwen-test"
USER = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
OPENAI_WEATHER = {
    "type": "function",
    "function": {k.replace("input_schema", "parameters"): v for k, v in WEATHER.items()},
}
TOOL_CALL_SCRIPT = (
    "I should look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call>"
)
ANSWER_SCRIPT = "The tool said sunny.\n</think>\n\nIt is sunny in Paris."


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(real_tokenizer(), max_context=4096)


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    settings = Settings(
        model=ModelSettings(path="unused", served_name=MODEL),
        server=ServerSettings(api_key=API_KEY, keepalive=0.5),
    )
    with LiveServer(create_app(engine, real_tokenizer(), settings)) as live:
        yield live


@pytest.fixture
def sdk(server: LiveServer, engine: FakeEngine) -> anthropic.Anthropic:
    engine.reset()
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture
def http(server: LiveServer, engine: FakeEngine) -> Iterator[httpx.Client]:
    engine.reset()
    headers = {"x-api-key": API_KEY}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        yield client


def tool_script(engine: FakeEngine) -> None:
    """Call get_weather; answer once the tool result is in the prompt."""

    def script(request: GenerationRequest) -> str:
        prompt = engine.tokenizer.decode(list(request.prompt_ids))
        return ANSWER_SCRIPT if "<tool_response>" in prompt else TOOL_CALL_SCRIPT

    engine.script = script


def chat_prompt(http: httpx.Client, engine: FakeEngine, **body: Any) -> tuple[int, ...]:
    """The prompt ids the engine got for an OpenAI chat request."""
    response = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return engine.requests[-1].prompt_ids


def events(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(event name, data) of a streamed /v1/messages response."""
    response = http.post("/v1/messages", json={"model": MODEL, "stream": True, **body})
    assert response.status_code == 200, response.text
    return re.findall(r"event: (\w+)\ndata: (.*)\n\n", response.text)


def blocks(message: anthropic.types.Message) -> list[dict]:
    """A message's content blocks as plain dicts (stream snapshots add parsed fields)."""
    fields = {"type", "text", "thinking", "id", "name", "input"}
    return [block.model_dump(include=fields) for block in message.content]


def test_answer_has_thinking_then_text_block(sdk: anthropic.Anthropic) -> None:
    """Qwen thinks by default: a thinking block, then the answer; end_turn; usage counts."""
    message = sdk.messages.create(model=MODEL, max_tokens=64, messages=[USER])
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user greets me."
    assert message.content[1].text == "Hello! How can I help you today?"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.id.startswith("msg_") and message.model == MODEL
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert message.usage.cache_read_input_tokens == 0


@pytest.mark.parametrize("kind", ["enabled", "disabled"])
def test_thinking_switches_the_template(
    sdk: anthropic.Anthropic, engine: FakeEngine, kind: str
) -> None:
    """thinking disabled renders an empty think block (no thinking block comes back)."""
    thinking = {"type": kind} if kind == "disabled" else {"type": kind, "budget_tokens": 1024}
    message = sdk.messages.create(model=MODEL, max_tokens=64, messages=[USER], thinking=thinking)
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_ids))
    assert prompt.endswith("<think>\n\n</think>\n\n") == (kind == "disabled")
    types = [block.type for block in message.content]
    assert types == (["text"] if kind == "disabled" else ["thinking", "text"])


def test_system_and_turns_render_as_the_chat_does(
    sdk: anthropic.Anthropic, http: httpx.Client, engine: FakeEngine
) -> None:
    """System blocks, earlier turns with thinking: the prompt equals the OpenAI chat's."""
    earlier = [
        {"type": "thinking", "thinking": "Greet back.", "signature": ""},
        {"type": "text", "text": "Hi!"},
    ]
    sdk.messages.create(
        model=MODEL,
        max_tokens=8,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[USER, {"role": "assistant", "content": earlier}, USER],
    )
    got = engine.requests[-1].prompt_ids
    answer = {"role": "assistant", "content": "Hi!", "reasoning_content": "Greet back."}
    system = {"role": "system", "content": "Be brief."}
    assert got == chat_prompt(http, engine, messages=[system, USER, answer, USER])


def test_stream_event_order_and_final_message(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    """message_start, each block's start/deltas/stop, message_delta, message_stop; the
    SDK's accumulated message equals the non-streaming one."""
    names = [name for name, _ in events(http, {"max_tokens": 64, "messages": [USER]})]
    compact = re.sub(r"(content_block_delta )+", "delta* ", " ".join(names) + " ")
    assert compact == (
        "message_start content_block_start delta* content_block_stop "
        "content_block_start delta* content_block_stop message_delta message_stop "
    )
    with sdk.messages.stream(model=MODEL, max_tokens=64, messages=[USER]) as stream:
        streamed = stream.get_final_message()
    created = sdk.messages.create(model=MODEL, max_tokens=64, messages=[USER])
    assert blocks(streamed) == blocks(created)
    assert (streamed.stop_reason, streamed.usage) == (created.stop_reason, created.usage)


def test_tools_round_trip(sdk: anthropic.Anthropic, http: httpx.Client, engine: FakeEngine) -> None:
    """tool_use with typed input and stop_reason tool_use; the tool_result goes back as
    the template's tool response (same prompt as the chat's) and the model answers."""
    tool_script(engine)
    first = sdk.messages.create(model=MODEL, max_tokens=128, messages=[USER], tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris", "days": 2})
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}
    turns = [USER, {"role": "assistant", "content": first.content}]
    turns.append({"role": "user", "content": [result]})
    second = sdk.messages.create(model=MODEL, max_tokens=128, tools=[WEATHER], messages=turns)
    assert second.stop_reason == "end_turn" and second.content[-1].text == "It is sunny in Paris."
    got = engine.requests[-1].prompt_ids
    function = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    openai_call = {"id": call.id, "type": "function", "function": function}
    answer = {"role": "assistant", "content": "", "tool_calls": [openai_call]}
    answer["reasoning_content"] = "I should look it up."
    tool = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    messages = [USER, answer, tool]
    assert got == chat_prompt(http, engine, messages=messages, tools=[OPENAI_WEATHER])


def test_tool_use_streams_input_json(
    sdk: anthropic.Anthropic, http: httpx.Client, engine: FakeEngine
) -> None:
    """A streamed call: tool_use block start, input_json_delta fragments, same input."""
    tool_script(engine)
    body = {"max_tokens": 128, "messages": [USER], "tools": [WEATHER]}
    stream = events(http, body)
    starts = [data for name, data in stream if name == "content_block_start"]
    assert '"type":"tool_use"' in starts[-1] and '"name":"get_weather"' in starts[-1]
    assert any('"input_json_delta"' in data for _, data in stream)
    assert '"stop_reason":"tool_use"' in stream[-2][1]
    with sdk.messages.stream(model=MODEL, **body) as sdk_stream:
        final = sdk_stream.get_final_message()
    assert final.content[-1].input == {"city": "Paris", "days": 2}


def test_tool_choice_none_hides_tools(sdk: anthropic.Anthropic, engine: FakeEngine) -> None:
    """tool_choice none: the template gets no tools and the text is not parsed for calls."""
    tool_script(engine)
    message = sdk.messages.create(
        model=MODEL, max_tokens=128, messages=[USER], tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert "get_weather" not in engine.tokenizer.decode(list(engine.requests[-1].prompt_ids))
    assert message.stop_reason == "end_turn" and "<tool_call>" in message.content[-1].text


def test_stop_sequence_and_max_tokens(sdk: anthropic.Anthropic) -> None:
    """stop_sequences cut the text and are reported; max_tokens ends with max_tokens."""
    off = {"type": "disabled"}
    stopped = sdk.messages.create(
        model=MODEL, max_tokens=64, messages=[USER], thinking=off, stop_sequences=["x", "capital"]
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "capital")
    assert stopped.content[0].text == " Paris is the "
    cut = sdk.messages.create(model=MODEL, max_tokens=3, messages=[USER], thinking=off)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_count_tokens_matches_usage(sdk: anthropic.Anthropic) -> None:
    """count_tokens counts the prompt the message would get (system and tools included)."""
    kwargs: Any = {"model": MODEL, "messages": [USER], "system": "Be brief.", "tools": [WEATHER]}
    count = sdk.messages.count_tokens(**kwargs).input_tokens
    usage = sdk.messages.create(max_tokens=4, **kwargs).usage
    assert count == usage.input_tokens + usage.cache_read_input_tokens > 0
    assert count > sdk.messages.count_tokens(model=MODEL, messages=[USER]).input_tokens


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_image_block_is_the_chat_image(
    sdk: anthropic.Anthropic, http: httpx.Client, engine: FakeEngine
) -> None:
    """A base64 image block reaches the engine as the same image and prompt as the
    equivalent OpenAI image_url part."""
    data = _png()
    source = {"type": "base64", "media_type": "image/png", "data": data}
    parts = [{"type": "image", "source": source}, {"type": "text", "text": "Describe"}]
    sdk.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": parts}])
    got = engine.requests[-1]
    url = {"url": f"data:image/png;base64,{data}"}
    openai_parts = [{"type": "image_url", "image_url": url}, {"type": "text", "text": "Describe"}]
    ids = chat_prompt(http, engine, messages=[{"role": "user", "content": openai_parts}])
    assert got.prompt_ids == ids and len(got.images) == 1
    assert got.images[0].digest == engine.requests[-1].images[0].digest


def user_blocks(*blocks: dict) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


HTTP_IMAGE = {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}
PICK_X = {"type": "tool", "name": "x"}
# (id, body fields, status, what the message must name); http image URLs are off here.
ERROR_CASES = [
    ("no-max-tokens", {}, 400, "max_tokens"),
    ("bad-model", {"model": "claude"}, 404, "claude"),
    ("temperature", {"temperature": -1}, 400, "temperature"),
    ("temperature-above-one", {"temperature": 1.5}, 400, "temperature"),
    ("top-p-above-one", {"top_p": 1.5}, 400, "top_p"),
    ("max-tokens-zero", {"max_tokens": 0}, 400, "max_tokens"),
    ("too-long", {"max_tokens": 10**6}, 400, "max_tokens"),
    ("block-type", {"messages": user_blocks({"type": "document"})}, 400, "messages.0.content"),
    ("tool-choice", {"tools": [WEATHER], "tool_choice": PICK_X}, 400, "tool_choice"),
    ("image-http-off", {"messages": user_blocks(HTTP_IMAGE)}, 400, "messages[0].content[0]"),
]
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_errors_take_anthropic_shape(
    http: httpx.Client, body: dict, status: int, names: str
) -> None:
    """Each bad request: the right status, {"type": "error", "error": {type, message}}."""
    sized = {"max_tokens": 8} if body else {}  # the first case leaves max_tokens out
    request = {"model": MODEL, "messages": [USER], **sized, **body}
    response = http.post("/v1/messages", json=request)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == ERROR_TYPES[status], error
    assert names in error["error"]["message"], error


def test_engine_refusal_and_stream_failure(
    sdk: anthropic.Anthropic, http: httpx.Client, engine: FakeEngine
) -> None:
    """A full queue is a 429 rate_limit_error; a failure mid-stream an `error` event."""
    engine.refuse_next = QueueFullError(retry_after=2)
    with pytest.raises(anthropic.RateLimitError):
        sdk.messages.create(model=MODEL, max_tokens=8, messages=[USER])
    engine.raise_after = 2
    stream = events(http, {"max_tokens": 64, "messages": [USER]})
    assert stream[0][0] == "message_start" and stream[-1][0] == "error"
    assert '"type":"error"' in stream[-1][1] and '"api_error"' in stream[-1][1]
    engine.raise_after = None
    body = {"model": MODEL, "max_tokens": 4, "messages": [USER]}
    assert http.post("/v1/messages", json=body).status_code == 200  # still serving


def test_pings_while_waiting(http: httpx.Client, engine: FakeEngine) -> None:
    """While no token comes, the stream sends `ping` events."""
    engine.first_token_delay = 1.3
    names = [name for name, _ in events(http, {"max_tokens": 4, "messages": [USER]})]
    assert names[0] == "message_start" and "ping" in names
    assert names[-2:] == ["message_delta", "message_stop"]


def test_api_key_as_x_api_key_or_bearer(server: LiveServer) -> None:
    """Both headers work on every route; a wrong key is a 401 in the route's shape."""
    body = {"model": MODEL, "max_tokens": 4, "messages": [USER]}
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    for headers in ({"x-api-key": API_KEY}, bearer):
        for path in ("/v1/messages", "/v1/chat/completions"):
            assert httpx.post(server.url + path, json=body, headers=headers).status_code == 200
    wrong = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    openai_wrong = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert openai_wrong.status_code == 401
    assert openai_wrong.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[USER]
        )
