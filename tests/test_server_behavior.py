"""Route behaviour beyond shapes: stop strings abort the engine request, disconnects abort,
keep-alives during a long prefill, in-band stream errors, tool_choice handling, defaults
from settings, /health, /metrics, CORS and shutdown. Live uvicorn + FakeEngine."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, LiveServer, live_fake_server, parse_sse, real_tokenizer

from deltaserve.server.app import create_app
from deltaserve.server.settings import ModelSettings, SamplingDefaults, ServerSettings, Settings

MODEL = "qwen-test"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
ORIGIN = "http://app.example"
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
TWO_CALLS = (
    "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)
SETTINGS = Settings(
    model=ModelSettings(path="unused", served_name=MODEL),
    server=ServerSettings(keepalive=0.2, cors_origins=(ORIGIN,)),
    sampling=SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, max_tokens=2048),
)


engine, server, http = live_fake_server(SETTINGS)


def chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    response = http.post(CHAT, json={"model": MODEL, "messages": USER, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(condition: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def prompt_text(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(list(engine.requests[-1].prompt_ids))


def test_stop_string_cuts_text_and_aborts(http: httpx.Client, engine: FakeEngine) -> None:
    """A stop string ends the choice with "stop", hides the stop text, aborts the engine."""
    body = chat(http, stop=["help"])
    assert body["choices"][0]["message"]["content"] == "Hello! How can I "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert set(engine.aborted) == {engine.requests[-1].request_id}


def test_n_is_one_engine_request(http: httpx.Client, engine: FakeEngine) -> None:
    """n=3 is a single GenerationRequest with n=3 (one shared prefill), three choices."""
    body = chat(http, n=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len(engine.requests) == 1 and engine.requests[0].n == 3


def test_defaults_and_context_cap(http: httpx.Client, engine: FakeEngine) -> None:
    """Unset sampling fields take settings' defaults; unset max_tokens fits the context."""
    chat(http)
    params = engine.requests[-1].params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert params.max_tokens == 1024 - len(engine.requests[-1].prompt_ids)
    chat(http, temperature=0, max_completion_tokens=7, seed=3, logit_bias={"42": -100})
    params = engine.requests[-1].params
    assert (params.temperature, params.max_tokens, params.seed) == (0, 7, 3)
    assert params.logit_bias == {42: -100.0}


@pytest.mark.parametrize(
    ("fields", "thinks"),
    [
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, False),
    ],
    ids=["none", "low", "high", "kwargs-on-win", "kwargs-off-win"],
)
def test_reasoning_effort_switches_thinking(
    http: httpx.Client, engine: FakeEngine, fields: dict[str, Any], thinks: bool
) -> None:
    """reasoning_effort "none" renders the prompt with thinking off (as enable_thinking:
    false does), any other effort with it on; an explicit enable_thinking wins."""
    prompts = {}
    for enabled in (True, False):
        chat(http, max_tokens=1, chat_template_kwargs={"enable_thinking": enabled})
        prompts[enabled] = engine.requests[-1].prompt_ids
    assert prompts[True] != prompts[False]
    chat(http, max_tokens=1, **fields)
    assert engine.requests[-1].prompt_ids == prompts[thinks]


def test_length_finish(http: httpx.Client) -> None:
    """max_tokens reached → finish_reason "length" and that many completion tokens."""
    body = chat(http, max_tokens=2)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


def test_stream_disconnect_aborts(server: LiveServer, engine: FakeEngine) -> None:
    """Closing a stream mid-way aborts the engine request."""
    engine.reset()
    engine.token_delay = 0.02
    body = {"model": MODEL, "messages": USER, "stream": True, "ignore_eos": True, "max_tokens": 900}
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, timeout=10) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    assert wait_for(lambda: engine.requests and engine.requests[0].request_id in engine.aborted)


def test_non_stream_disconnect_aborts(server: LiveServer, engine: FakeEngine) -> None:
    """A non-streaming client that goes away (timeout) gets its request aborted."""
    engine.reset()
    engine.token_delay = 0.02
    body = {"model": MODEL, "messages": USER, "ignore_eos": True, "max_tokens": 900}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{CHAT}", json=body, timeout=0.3)
    assert wait_for(lambda: engine.requests and engine.requests[0].request_id in engine.aborted)


def test_keepalive_during_long_prefill(http: httpx.Client, engine: FakeEngine) -> None:
    """While no token has come, SSE comments keep the connection alive."""
    engine.first_token_delay = 1.0
    response = http.post(CHAT, json={"model": MODEL, "messages": USER, "stream": True})
    assert response.content.count(b": keep-alive\n\n") >= 2
    assert parse_sse(response.content)[-1] == "[DONE]"


@pytest.mark.parametrize("fault", ["raise_after", "error_after"])
def test_error_after_stream_started_is_in_band(
    http: httpx.Client, engine: FakeEngine, fault: str
) -> None:
    """A failure mid-stream: status stays 200, an error event, then [DONE]."""
    setattr(engine, fault, 3)
    response = http.post(CHAT, json={"model": MODEL, "messages": USER, "stream": True})
    assert response.status_code == 200
    events = parse_sse(response.content)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error" and events[-2]["error"]["message"]
    assert http.get("/health").status_code == 200


def test_tool_choice_none_hides_tools(http: httpx.Client, engine: FakeEngine) -> None:
    """tool_choice "none": no tools in the prompt, and no tool-call parsing of the output."""
    engine.script = lambda request: TWO_CALLS
    body = chat(http, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in prompt_text(engine)
    assert "tool_calls" not in body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_named_tool_choice_sends_only_that_tool(http: httpx.Client, engine: FakeEngine) -> None:
    """A named tool_choice puts only that function in the template."""
    chat(http, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert '"get_time"' in prompt_text(engine) and '"get_weather"' not in prompt_text(engine)


def test_required_without_a_call_returns_text(http: httpx.Client) -> None:
    """Not grammar-constrained: under "required" a prose answer is still returned."""
    body = chat(http, tools=TOOLS, tool_choice="required")
    assert body["choices"][0]["message"]["content"] == "Hello! How can I help you today?"
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls(http: httpx.Client, engine: FakeEngine, parallel: bool) -> None:
    """parallel_tool_calls=false keeps only the first call (streaming and not)."""
    engine.script = lambda request: TWO_CALLS
    body = chat(http, tools=TOOLS, parallel_tool_calls=parallel)
    names = [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]]
    assert names == (["get_weather", "get_time"] if parallel else ["get_weather"])
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    stream = http.post(
        CHAT,
        json={
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "stream": True,
            "parallel_tool_calls": parallel,
        },
    )
    chunks = [e for e in parse_sse(stream.content)[:-1] if e["choices"]]
    indexes = {c["index"] for e in chunks for c in e["choices"][0]["delta"].get("tool_calls", [])}
    assert indexes == ({0, 1} if parallel else {0})


def test_health_follows_engine(http: httpx.Client, engine: FakeEngine) -> None:
    """/health is 200 while the engine is alive, 503 once it is not."""
    assert http.get("/health").json() == {"status": "ok"}
    engine.is_alive = False
    assert http.get("/health").status_code == 503


def test_metrics(http: httpx.Client) -> None:
    """Counters by status code, token counters, latency histograms and engine gauges."""
    chat(http)
    http.post(CHAT, json={"messages": []})
    text = http.get("/metrics").text
    assert 'deltaserve_http_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'deltaserve_http_requests_total{route="/v1/chat/completions",status="400"}' in text
    for name in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_bucket",
        "queue_depth",
        "running_rows",
    ):
        assert f"deltaserve_{name}" in text
    assert "deltaserve_state_bytes_in_use 1234.0" in text
    assert "deltaserve_mlx_peak_bytes 9999.0" in text


def test_cors(http: httpx.Client) -> None:
    """Configured origins get CORS headers (preflight included); others do not."""
    preflight = http.options(
        CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_shutdown_stops_engine() -> None:
    """Stopping uvicorn runs the lifespan shutdown, which calls engine.shutdown()."""
    engine = FakeEngine(real_tokenizer())
    with LiveServer(create_app(engine, real_tokenizer(), SETTINGS)):
        assert engine.num_shutdowns == 0
    assert engine.num_shutdowns == 1
