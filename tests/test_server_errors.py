"""Bad input over raw HTTP: the right status, OpenAI's error shape, the offending param,
and a server that keeps serving afterwards. Runs against a live uvicorn + FakeEngine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, LiveServer, real_tokenizer, spec_errors

from deltaserve.engine.api import QueueFullError
from deltaserve.engine.types import InvalidRequestError
from deltaserve.server.app import create_app
from deltaserve.server.settings import ModelSettings, ServerSettings, Settings

API_KEY = "test-key"
MODEL = "qwen-test"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(real_tokenizer(), max_context=1024)


@pytest.fixture(scope="module")
def client(engine: FakeEngine) -> Iterator[httpx.Client]:
    settings = Settings(
        model=ModelSettings(path="unused", served_name=MODEL),
        server=ServerSettings(api_key=API_KEY, keepalive=0.5),
    )
    with LiveServer(create_app(engine, real_tokenizer(), settings)) as server:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            yield http


@pytest.fixture(autouse=True)
def _fresh_engine(engine: FakeEngine) -> None:
    engine.reset()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The capital of France is", **fields}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def tool(function: dict[str, Any], kind: str = "function") -> dict[str, Any]:
    return {"type": kind, "function": function}


IMAGE_PARTS = [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]
IMAGE_URL = "messages[0].content[0].image_url"  # http fetching is off by default
LATE_SYSTEM = {"role": "system", "content": "late"}
STRING_PARAMS_TOOL = tool({"name": "f", "parameters": {"type": "string"}})
NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}
RESERVED = {"add_generation_prompt": False}
ROLE, TOOL_NAME = "messages.0.role", "tools.0.function.name"
TOOL_PARAMS = "tools.0.function.parameters"
TEMPLATE_KWARGS = "chat_template_kwargs"
FORMAT, FORMAT_TYPE = "response_format", "response_format.type"
USAGE, OPTIONS = {"include_usage": True}, "stream_options"  # OpenAI: only with stream: true
P_PENALTY = "presence_penalty"

# (id, path, JSON body or raw bytes, expected status, expected param)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("bad-json", CHAT, b'{"messages": [', 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("body-not-object", CHAT, b"[1, 2]", 400, None),
    ("messages-missing", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("messages-not-list", CHAT, chat(messages="hi"), 400, "messages"),
    ("unknown-role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, ROLE),
    ("no-content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0"),
    ("content-number", CHAT, chat(messages=[user(42)]), 400, "messages.0.content"),
    ("image-http-off", CHAT, chat(messages=[user(IMAGE_PARTS)]), 400, IMAGE_URL),
    ("system-not-first", CHAT, chat(messages=[*USER, LATE_SYSTEM]), 400, "messages"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature-huge", CHAT, chat(temperature=1000), 400, "temperature"),
    ("temperature-above-openai-range", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("frequency-penalty-low", CHAT, chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-k-negative", CHAT, chat(top_k=-1), 400, "top_k"),
    ("min-p-above-one", CHAT, chat(min_p=1.5), 400, "min_p"),
    ("presence-penalty", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("repetition-penalty-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed-negative", CHAT, chat(seed=-1), 400, "seed"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-string", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**12), 400, "max_tokens"),
    ("max-completion-huge", CHAT, chat(max_completion_tokens=5000), 400, "max_completion_tokens"),
    ("max-completion-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("prompt-too-long", CHAT, chat(messages=[user("word " * 2000)]), 400, "messages"),
    ("n-zero", CHAT, chat(n=0), 400, "n"),
    ("n-negative", CHAT, chat(n=-1), 400, "n"),
    ("n-huge", CHAT, chat(n=1000), 400, "n"),
    ("n-string", CHAT, chat(n="2"), 400, "n"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("reasoning-effort-unknown", CHAT, chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    ("logit-bias-key", CHAT, chat(logit_bias={"hello": 1}), 400, "logit_bias"),
    ("logit-bias-value", CHAT, chat(logit_bias={"42": 500}), 400, "logit_bias"),
    ("logit-bias-not-in-vocab", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("logit-bias-type", CHAT, chat(logit_bias={"42": "up"}), 400, "logit_bias.42"),
    ("stop-number", CHAT, chat(stop=5), 400, "stop"),
    ("stop-too-many", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop-empty-string", CHAT, chat(stop=[""]), 400, "stop"),
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream"),
    ("tool-name-space", CHAT, chat(tools=[tool({"name": "get weather"})]), 400, TOOL_NAME),
    ("tool-name-missing", CHAT, chat(tools=[tool({})]), 400, TOOL_NAME),
    ("tool-params-not-object", CHAT, chat(tools=[STRING_PARAMS_TOOL]), 400, TOOL_PARAMS),
    ("tool-type", CHAT, chat(tools=[tool({"name": "f"}, "retrieval")]), 400, "tools.0.type"),
    ("tool-choice-unknown", CHAT, chat(tools=[TOOL], tool_choice=NAMED_NOPE), 400, "tool_choice"),
    ("tool-choice-required-no-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool-choice-bad-value", CHAT, chat(tools=[TOOL], tool_choice="maybe"), 400, "tool_choice"),
    ("template-kwargs-reserved", CHAT, chat(chat_template_kwargs=RESERVED), 400, TEMPLATE_KWARGS),
    ("unknown-model", CHAT, chat(model="gpt-4"), 404, "model"),
    ("response-format-type", CHAT, chat(response_format={"type": "bad"}), 400, FORMAT_TYPE),
    ("json-schema-missing", CHAT, chat(response_format={"type": "json_schema"}), 400, FORMAT),
    ("stream-options-no-stream", CHAT, chat(stream_options=USAGE), 400, "stream_options"),
    ("completions-stream-options", COMPLETIONS, completion(stream_options=USAGE), 400, OPTIONS),
    ("completions-no-prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    ("completions-empty-list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("completions-negative-id", COMPLETIONS, completion(prompt=[1, -2]), 400, "prompt.1"),
    ("completions-id-not-in-vocab", COMPLETIONS, completion(prompt=[10**7]), 400, "prompt"),
    ("completions-suffix", COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    ("completions-echo-logprobs", COMPLETIONS, completion(echo=True, logprobs=1), 400, "echo"),
    ("completions-logprobs-too-many", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    ("completions-logprobs-negative", COMPLETIONS, completion(logprobs=-1), 400, "logprobs"),
    ("completions-temperature", COMPLETIONS, completion(temperature=5), 400, "temperature"),
    ("completions-presence-penalty", COMPLETIONS, completion(presence_penalty=9), 400, P_PENALTY),
    ("completions-n-zero", COMPLETIONS, completion(n=0), 400, "n"),
    ("completions-best-of", COMPLETIONS, completion(best_of=3), 400, "best_of"),
    ("completions-too-long", COMPLETIONS, completion(max_tokens=2000), 400, "max_tokens"),
    ("completions-unknown-model", COMPLETIONS, completion(model="davinci"), 404, "model"),
]


def check_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The response is `status` with a spec-valid ErrorResponse body naming `param`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert spec_errors("ErrorResponse", body) == []
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_gets_openai_error(
    client: httpx.Client,
    engine: FakeEngine,
    path: str,
    body: Any,
    status: int,
    param: str | None,
) -> None:
    """Each bad request gets its 4xx with the OpenAI error shape and the offending param,
    and never reaches the engine."""
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = client.post(path, json=body)
    check_error(response, status, param)
    assert engine.requests == []


# The edges of OpenAI's ranges are allowed (openai-openapi.yaml).
EDGES = [
    {"temperature": 0},
    {"temperature": 2},
    {"top_p": 1},
    {"presence_penalty": -2, "frequency_penalty": 2},
    {"logprobs": True, "top_logprobs": 20},
    {"reasoning_effort": "none"},
]


@pytest.mark.parametrize("fields", EDGES, ids=[",".join(e) for e in EDGES])
def test_range_edges_are_accepted(
    client: httpx.Client, engine: FakeEngine, fields: dict[str, Any]
) -> None:
    """A value at the edge of OpenAI's documented range is served, not refused."""
    response = client.post(CHAT, json=chat(max_tokens=2, **fields))
    assert response.status_code == 200, response.text
    assert len(engine.requests) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_400_also_when_streaming(client: httpx.Client, stream: bool) -> None:
    """A streaming request is validated before any byte of the stream is sent."""
    check_error(client.post(CHAT, json=chat(temperature=-1, stream=stream)), 400, "temperature")


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({}, chat()),
        ({"Authorization": "Bearer wrong"}, chat()),
        ({"Authorization": API_KEY}, chat()),
        ({}, b"{bad"),
    ],
    ids=["missing", "wrong", "no-bearer-scheme", "missing-with-bad-json"],
)
def test_api_key_required(client: httpx.Client, headers: dict[str, str], body: Any) -> None:
    """/v1 answers 401 without the right Bearer key, before looking at the body."""
    url = client.base_url.join(CHAT)
    payload = {"content": body} if isinstance(body, bytes) else {"json": body}
    check_error(httpx.post(url, headers=headers, **payload), 401)


def test_models_needs_key_but_probes_do_not(client: httpx.Client) -> None:
    """GET /v1/models is authenticated; /health and /metrics are open."""
    url = client.base_url.join
    assert httpx.get(url("/v1/models")).status_code == 401
    assert httpx.get(url("/health")).status_code == 200
    assert httpx.get(url("/metrics")).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_429_with_retry_after(
    client: httpx.Client, engine: FakeEngine, stream: bool
) -> None:
    """QueueFullError from the engine → 429 + Retry-After (rounded up to whole seconds)."""
    engine.refuse_next = QueueFullError(retry_after=2.5)
    response = client.post(CHAT, json=chat(stream=stream))
    assert check_error(response, 429)["type"] == "rate_limit_error"
    assert response.headers["Retry-After"] == "3"


def test_engine_invalid_request_is_400_with_its_param(
    client: httpx.Client, engine: FakeEngine
) -> None:
    """InvalidRequestError raised by the engine (e.g. cannot fit memory) → 400 + its param."""
    engine.refuse_next = InvalidRequestError("the request can never fit in memory", "max_tokens")
    error = check_error(client.post(CHAT, json=chat()), 400, "max_tokens")
    assert "never fit" in error["message"]


def test_engine_fault_is_500_and_server_keeps_serving(
    client: httpx.Client, engine: FakeEngine
) -> None:
    """A crash inside generation is a 500 for that request only."""
    engine.raise_after = 2
    assert check_error(client.post(CHAT, json=chat()), 500)["type"] == "server_error"
    engine.raise_after = None
    assert client.post(CHAT, json=chat()).status_code == 200


def test_dead_engine_is_503(client: httpx.Client, engine: FakeEngine) -> None:
    """With the engine thread gone, requests fail fast with 503 (and /health says so)."""
    engine.is_alive = False
    assert check_error(client.post(CHAT, json=chat()), 503)["code"] == "engine_unavailable"
    assert client.get("/health").status_code == 503


def test_unknown_route_and_method(client: httpx.Client) -> None:
    """Starlette's own 404/405 come back in the OpenAI shape too."""
    check_error(client.get("/v1/nothing"), 404)
    check_error(client.get(CHAT), 405)
    check_error(client.get("/v1/models/gpt-4"), 404, "model")


def test_still_healthy_after_bad_input(client: httpx.Client, engine: FakeEngine) -> None:
    """After the matrix above: the server is healthy and a good request succeeds."""
    assert client.get("/health").json() == {"status": "ok"}
    response = client.post(CHAT, json=chat(max_tokens=5))
    assert response.status_code == 200
    assert engine.requests[-1].params.max_tokens == 5
