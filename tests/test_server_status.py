"""What the operator sees, on a live uvicorn + FakeEngine: one record and one log line per
finished request (every route, disconnects and failures included), the status page's
JSON and its auth, /metrics labels for every route, and /docs without a CDN."""

from __future__ import annotations

import base64
import logging
import re
import time

import httpx
import pytest
from fake_engine import FakeEngine, LiveServer, live_fake_server

from deltaserve.engine.api import EngineStats
from deltaserve.server.request_log import CLIENT_GONE, RequestLog, RequestRecord
from deltaserve.server.settings import ModelSettings, ServerSettings, Settings
from deltaserve.server.status_history import StatusHistory

MODEL = "qwen-test"
API_KEY = "status-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]
SETTINGS = Settings(
    model=ModelSettings(path="unused", served_name=MODEL),
    server=ServerSettings(api_key=API_KEY, keepalive=0.2),
)


engine, server, http = live_fake_server(SETTINGS, headers=AUTH)


def records(server: LiveServer) -> list[RequestRecord]:
    """The app's kept records, newest first."""
    return server.app.state.deltaserve.requests.recent()


def wait_for_records(server: LiveServer, count: int, timeout: float = 5.0) -> None:
    """Until the app has made `count` records since start."""
    deadline = time.monotonic() + timeout
    while server.app.state.deltaserve.requests.num_finished < count:
        assert time.monotonic() < deadline, "the request's record never came"
        time.sleep(0.02)


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def test_each_route_records_its_request_and_logs_one_line(
    server: LiveServer, http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """chat, completions (two prompts: one record) and messages each make one record
    with the id, tokens and finish reason their client saw, and one info log line."""
    caplog.set_level(logging.INFO, logger="deltaserve.requests")
    before = server.app.state.deltaserve.requests.num_finished
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}).json()
    completion = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 3}
    ).json()
    message = http.post(
        "/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 5}
    ).json()
    wait_for_records(server, before + 3)

    by_route = {record.route: record for record in records(server)[:3]}
    assert set(by_route) == {"chat", "completions", "messages"}
    for record, body, finish in [
        (by_route["chat"], chat, chat["choices"][0]["finish_reason"]),
        (by_route["completions"], completion, "length"),
    ]:
        assert record.request_id == body["id"]
        assert record.num_prompt == body["usage"]["prompt_tokens"]
        assert record.num_output == body["usage"]["completion_tokens"]
        assert record.finish == finish
        assert record.ttft_s is not None and 0 <= record.ttft_s <= record.duration_s
    assert by_route["messages"].request_id == message["id"]
    assert by_route["messages"].num_output == message["usage"]["output_tokens"] == 5
    assert by_route["messages"].finish == "length"

    lines = [r.getMessage() for r in caplog.records if r.name == "deltaserve.requests"]
    levels = {r.levelno for r in caplog.records if r.name == "deltaserve.requests"}
    assert len(lines) == 3 and levels == {logging.INFO}
    chat_line = next(line for line in lines if chat["id"] in line)
    prompt, output = chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"]
    assert f"route=chat prompt={prompt} cached=0 completion={output} ttft=" in chat_line
    assert re.search(r"tokens/s=[\d.]+ ", chat_line)
    assert chat_line.endswith(f"finish={chat['choices'][0]['finish_reason']}")


def test_record_times_come_from_the_stream(
    server: LiveServer, http: httpx.Client, engine: FakeEngine
) -> None:
    """TTFT covers the wait for the first token; tokens/s is bounded by the step delay."""
    engine.first_token_delay, engine.token_delay = 0.1, 0.02
    before = server.app.state.deltaserve.requests.num_finished
    http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 8})
    wait_for_records(server, before + 1)
    record = records(server)[0]
    # the event loop's timers are millisecond-grained (uvloop: libuv), so a 0.1 s sleep
    # may end up to a millisecond before 0.1 s by time.monotonic
    assert record.ttft_s is not None and record.ttft_s >= 0.1 - 0.002
    assert record.tokens_per_s is not None and 0 < record.tokens_per_s <= 1 / 0.02


def test_client_that_leaves_is_recorded(
    server: LiveServer, http: httpx.Client, engine: FakeEngine
) -> None:
    """A stream dropped mid-way is recorded as "client went away", with its tokens so far."""
    engine.token_delay = 0.05
    before = server.app.state.deltaserve.requests.num_finished
    body = {"model": MODEL, "messages": USER, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        for num_lines, _ in enumerate(reply.iter_lines()):
            if num_lines >= 6:
                break
    wait_for_records(server, before + 1)
    record = records(server)[0]
    assert record.finish == CLIENT_GONE
    assert record.num_output >= 1


def test_failed_generation_is_recorded(
    server: LiveServer, http: httpx.Client, engine: FakeEngine
) -> None:
    """A generation the engine fails mid-way is recorded with the error."""
    engine.error_after = 2
    before = server.app.state.deltaserve.requests.num_finished
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert reply.status_code == 500
    wait_for_records(server, before + 1)
    assert records(server)[0].finish == "error: generation failed: fake step failed"


def test_request_log_keeps_the_latest() -> None:
    """The ring keeps the newest `capacity` records, newest first; the count goes on."""
    log = RequestLog(capacity=3)
    for k in range(5):
        log.add(RequestRecord(f"id-{k}", "chat", 1, 0, 1, 0.1, None, "stop", 0.0, 0.1))
    assert [record.request_id for record in log.recent()] == ["id-4", "id-3", "id-2"]
    assert log.num_finished == 5


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/data", "/dashboard/dashboard.js"])
def test_dashboard_needs_the_key(server: LiveServer, path: str) -> None:
    """Without the key: 401 asking for HTTP Basic (so a browser shows a log-in box); the
    key passes as Basic's password or as a Bearer token; a wrong one does not."""
    url = server.url + path
    missing = httpx.get(url)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Basic ")
    assert httpx.get(url, headers=basic("anyone", API_KEY)).status_code == 200
    assert httpx.get(url, headers=AUTH).status_code == 200
    assert httpx.get(url, headers=basic("anyone", "wrong")).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Basic !!"}).status_code == 401


def test_v1_takes_no_basic_auth(server: LiveServer) -> None:
    """/v1 keeps its Bearer / x-api-key auth only."""
    reply = httpx.get(f"{server.url}/v1/models", headers=basic("anyone", API_KEY))
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"] == "Bearer"


def test_dashboard_data(server: LiveServer, http: httpx.Client) -> None:
    """The page's one JSON: engine rows and memory from EngineStats, the latest records,
    totals, platform and settings (which say a key is set, never the key)."""
    http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    reply = http.get("/dashboard/data")
    assert reply.headers["cache-control"] == "no-store"
    data = reply.json()
    assert data["engine"]["state_bytes_in_use"] == 1234  # FakeEngine's stats
    assert data["engine"]["alive"] is True
    assert data["totals"]["finished_requests"] == server.app.state.deltaserve.requests.num_finished
    newest = data["requests"][0]
    assert newest["route"] == "chat" and newest["request_id"].startswith("chatcmpl-")
    assert data["ttft"] and data["ttft"][-1] == [newest["finished_at"], newest["ttft_s"]]
    assert data["platform"]["device"] == "cpu" and data["platform"]["max_context"] == 1024
    assert data["settings"]["server.api_key"] == "set"
    assert data["settings"]["engine.max_num_seqs"] == SETTINGS.engine.max_num_seqs
    # left at 0 (the device's choice): the engine's value in force, said to be its own
    assert data["settings"]["engine.max_num_batched_tokens"] == "512 (this device's default)"
    assert API_KEY not in reply.text
    assert data["prefix_cache"]["enabled"] is False
    assert data["steps"] == {  # FakeEngine's stats: no step yet
        "kinds": {
            k: {"count": 0, "mean_ms": None, "host_mean_ms": None}
            for k in ("decode", "mixed", "prefill", "verify")
        },
        "traced": 0,
    }


def _stats(generated: int, running: int) -> EngineStats:
    return EngineStats(True, 2, running, 0, 1, 1, 0, 0, 0, generated)


def test_history_series() -> None:
    """tokens/s between successive samples; running and queued rows as sampled; only
    the window's samples are kept."""
    history = StatusHistory(interval_s=1.0, window_s=3.0)
    for second, generated in enumerate([0, 10, 30, 30, 70]):
        history.add(_stats(generated, running=second), now=100.0 + second)
    series = history.series()
    assert series["time"] == [102.0, 103.0, 104.0]  # 4 samples kept: 101..104
    assert series["tokens_per_s"] == [20.0, 0.0, 40.0]
    assert series["running"] == [2, 3, 4]
    assert series["queued"] == [2, 2, 2]


def test_dashboard_page_loads_only_local_assets(server: LiveServer) -> None:
    """The page's script and style come from this server, and exist."""
    page = httpx.get(f"{server.url}/dashboard", headers=AUTH).text
    for url in _asset_urls(page):
        assert url.startswith("/dashboard/"), url
        assert httpx.get(server.url + url, headers=AUTH).status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_docs_render_offline(server: LiveServer, path: str) -> None:
    """/docs (Swagger UI) and /redoc reference no external URL; every script, style and
    icon they name comes from this server with a 200, and so does the OpenAPI schema."""
    page = httpx.get(server.url + path)
    assert page.status_code == 200
    urls = _asset_urls(page.text)
    assert any(url.endswith(".js") for url in urls), urls
    assert not re.search(r"https?://|//cdn", page.text), page.text
    for url in urls:
        asset = httpx.get(server.url + url)
        assert asset.status_code == 200 and asset.content, url
    assert httpx.get(f"{server.url}/openapi.json").json()["info"]["title"] == "deltaserve"


def _asset_urls(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]+)"', html)


def test_metrics_label_every_route(server: LiveServer, http: httpx.Client) -> None:
    """Each route is counted under its own path template; unmatched paths under "other"."""
    http.post("/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 2})
    http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER})
    http.get(f"/v1/models/{MODEL}")
    http.get("/dashboard/data")
    http.get("/no/such/path")
    text = http.get("/metrics").text
    for route, status in [
        ("/v1/messages", 200),
        ("/v1/messages/count_tokens", 200),
        ("/v1/models/{model_id:path}", 200),
        ("/dashboard/data", 200),
        ("other", 404),
    ]:
        assert f'deltaserve_http_requests_total{{route="{route}",status="{status}"}}' in text
