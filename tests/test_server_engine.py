"""The server on the real engine (tiny peaked checkpoint): HTTP output equals the offline
engine, many concurrent streams complete, disconnects and aborts free rows."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import re
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from fake_engine import LiveServer, served_checkpoint
from PIL import Image

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.chat_format import IM_END_ID, THINK_CLOSE_ID
from deltaserve.server.frontend.messages import image_refs
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.images import load_images, processor_config
from deltaserve.server.settings import (
    ImageSettings,
)

MODEL = "tiny"
CONFIG = EngineConfig(max_num_seqs=64, max_num_batched_tokens=256, max_prefill_chunk=128)


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
def server(served: tuple[AsyncEngine, TextTokenizer, LiveServer]) -> LiveServer:
    return served[2]


def _running_rows(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("deltaserve_running_rows "):
            return float(line.split()[1])
    raise AssertionError("running_rows gauge missing")


def _wait_idle(base: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _running_rows(base) == 0:
            return True
        time.sleep(0.05)
    return False


def test_greedy_http_equals_offline_engine(
    server: LiveServer, engine: AsyncEngine, tokenizer: TextTokenizer
) -> None:
    """/v1/completions with token ids returns the text of the offline engine's tokens."""
    got = _greedy_against_offline(server, engine, tokenizer, 24)
    assert got["usage"]["completion_tokens"] == 24


def _greedy_against_offline(
    server: LiveServer, engine: AsyncEngine, tokenizer: TextTokenizer, max_tokens: int
) -> dict:
    """A greedy /v1/completions answer, asserted equal to the offline engine's tokens'
    text (CONFIG, the served model); returns the response."""
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    offline = LLMEngine(engine.engine.loaded, CONFIG).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )[0]
    visible = [t for t in offline.token_ids if t not in tokenizer.hidden_token_ids]
    assert got["choices"][0]["text"] == tokenizer.decode(visible)
    return got


def test_chat_stops_at_im_end(server: LiveServer, engine: AsyncEngine) -> None:
    """On a published-layout checkpoint (config.json names only <|endoftext|>) a chat
    answer ends at <|im_end|> with finish_reason "stop" (no ignore_eos)."""
    assert IM_END_ID in engine.eos_token_ids
    body = {
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "logit_bias": {str(IM_END_ID): 100},
        "messages": [{"role": "user", "content": "Say hello"}],
    }
    got = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert got["choices"][0]["finish_reason"] == "stop"
    # The peaked test head can outbid +100 for a token or two; without <|im_end|> as a
    # stop id the answer would run to max_tokens ("length").
    assert got["usage"]["completion_tokens"] < body["max_tokens"]


def test_thinking_budget_closes_thinking_over_http(server: LiveServer) -> None:
    """max_thinking_tokens 4 with `</think>` biased away (random weights would think to
    max_tokens): each of n=2 choices has reasoning, then an answer, streamed or not."""
    body = {
        "model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2,
        "max_thinking_tokens": 4, "logit_bias": {str(THINK_CLOSE_ID): -100},
        "messages": [{"role": "user", "content": "Think briefly"}],
    }  # fmt: skip
    url = f"{server.url}/v1/chat/completions"
    got = httpx.post(url, json=body, timeout=60).json()
    messages = [choice["message"] for choice in got["choices"]]
    assert len(messages) == 2 and got["usage"]["completion_tokens"] == 24
    for message in messages:
        assert message["reasoning_content"] and message["content"]
        assert "</think>" not in message["reasoning_content"] + message["content"]
    streamed: dict[str, str] = {"reasoning_content": "", "content": ""}
    with httpx.stream("POST", url, json={**body, "n": 1, "stream": True}, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for key in streamed:
                        streamed[key] += choice["delta"].get(key) or ""
    assert streamed == {k: messages[0][k] for k in streamed}


def test_64_concurrent_streams_complete(server: LiveServer) -> None:
    """64 streaming clients at once: every stream ends with a finish_reason and [DONE]."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str | None, bool]:
        body = {
            "model": MODEL,
            "stream": True,
            "max_tokens": 6,
            "temperature": 0.7,
            "seed": i,
            "messages": [{"role": "user", "content": f"request {i} " * (1 + i % 7)}],
        }
        reason, done = None, False
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:]).get("choices", []):
                        reason = choice.get("finish_reason") or reason
        return reason, done

    async def run() -> list[tuple[str | None, bool]]:
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert all(done and reason in ("stop", "length") for reason, done in results)
    assert _wait_idle(server.url)
    # /metrics counted their steps: prompt work (alone or beside decode rows) and decoding
    metrics = httpx.get(f"{server.url}/metrics").text
    count = dict(re.findall(r'^deltaserve_step_seconds_count\{kind="(\w+)"\} (\S+)', metrics, re.M))
    assert set(count) == {"decode", "mixed", "prefill", "verify"}
    assert float(count["decode"]) > 0 and float(count["prefill"]) + float(count["mixed"]) > 0
    assert "deltaserve_traced_steps_total" in metrics
    # and the engine thread's own time on them, by the same kinds
    pattern = r'^deltaserve_step_host_seconds_total\{kind="(\w+)"\} (\S+)'
    host = dict(re.findall(pattern, metrics, re.M))
    assert set(host) == set(count) and float(host["decode"]) > 0
    # ... by part: each part of it there, none above the whole
    pattern = r'^deltaserve_step_host_part_seconds_total\{kind="decode",part="(\w+)"\} (\S+)'
    parts = {part: float(v) for part, v in re.findall(pattern, metrics, re.M)}
    assert set(parts) == {"schedule", "build", "submit", "sample", "update"}
    assert parts["build"] > 0 and sum(parts.values()) <= float(host["decode"]) + 1e-6


def test_stream_disconnect_frees_row(server: LiveServer) -> None:
    """A client that goes away mid-stream: its row is gone from /metrics within seconds."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "go on forever"}],
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert _running_rows(server.url) == 1
    assert _wait_idle(server.url)


def test_non_stream_abort_frees_row(server: LiveServer) -> None:
    """A non-streaming request whose client times out is aborted and its row freed."""
    body = {
        "model": MODEL,
        "max_tokens": 4000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "long answer please"}],
    }

    def call() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.0)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert _wait_idle(server.url)


def test_openai_sdk_seed_logprobs_and_n(server: LiveServer) -> None:
    """SDK round trips: seeded sampling repeats, logprobs come back, n=3 gives 3 choices."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Pick some words"}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0}
    first = client.chat.completions.create(seed=42, **kwargs)
    second = client.chat.completions.create(seed=42, **kwargs)
    assert first.choices[0].message.content == second.choices[0].message.content
    with_lp = client.chat.completions.create(
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}, **kwargs
    )
    entries = with_lp.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    many = client.chat.completions.create(n=3, seed=1, **kwargs)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]


def test_chat_turns_report_cached_tokens_and_metrics(
    server: LiveServer, tokenizer: TextTokenizer
) -> None:
    """A chat resent, then continued: both resume from the prefix cache (the history
    before the generation prompt is snapshotted), usage reports it as OpenAI does
    (prompt_tokens_details.cached_tokens), and /metrics counts it."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    user = {"role": "user", "content": "Tell me about caching. " * 150}
    kwargs = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    first, again = (client.chat.completions.create(messages=[user], **kwargs) for _ in "ab")
    history = len(tokenizer.encode(tokenizer.render_chat_text([user], None, None, False)))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens > history > 600
    assert again.usage.prompt_tokens_details.cached_tokens == history
    answer = {"role": "assistant", "content": "Caching keeps work for later."}
    follow = {"role": "user", "content": "And then?"}
    turn2 = client.chat.completions.create(messages=[user, answer, follow], **kwargs)
    assert turn2.usage.prompt_tokens_details.cached_tokens == history
    metrics = httpx.get(f"{server.url}/metrics").text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("deltaserve_prefix_cache_hit")]
    assert hits and float(hits[0].split()[1]) >= 2 * history
    assert "deltaserve_prefix_cache_bytes " in metrics


def _png_data_url(seed: int, size: tuple[int, int] = (64, 96)) -> str:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_openai_sdk_sends_images_end_to_end(
    server: LiveServer, engine: AsyncEngine, tokenizer: TextTokenizer
) -> None:
    """Two images in one user message through the SDK: the answer is the offline engine's
    greedy continuation of the same prompt and images, usage counts the image tokens,
    and the images reach the tower (another image changes the top logprobs)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

    def ask(seeds: tuple[int, int]):  # noqa: ANN202
        parts = [{"type": "text", "text": "Compare"}]
        parts += [{"type": "image_url", "image_url": {"url": _png_data_url(s)}} for s in seeds]
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=6,
            temperature=0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True},
        ), parts  # fmt: skip

    got, parts = ask((1, 2))
    messages = [{"role": "user", "content": parts}]
    settings = ImageSettings()
    images = load_images(image_refs(messages), settings, processor_config(tokenizer.model_dir))
    ids, _ = tokenizer.render_chat(messages, None, None, [im.num_tokens for im in images])
    assert got.usage.prompt_tokens == len(ids) > sum(im.num_tokens for im in images) > 0
    offline = LLMEngine(engine.engine.loaded, CONFIG)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline.add_request(GenerationRequest("img", tuple(ids), params, images=images))
    tokens = []
    while offline.has_work():
        tokens += [t for d in offline.step() for t in d.token_ids]
    visible = [t for t in tokens if t not in tokenizer.hidden_token_ids]
    message = got.choices[0].message  # the template opens in reasoning: all of it is there
    assert message.reasoning_content + message.content == tokenizer.decode(visible)
    other, _ = ask((1, 3))
    top = [[(e.token, e.logprob) for e in c.top_logprobs] for c in got.choices[0].logprobs.content]
    top_other = [
        [(e.token, e.logprob) for e in c.top_logprobs] for c in other.choices[0].logprobs.content
    ]
    assert top != top_other


def test_response_format_and_forced_tool_calls_are_enforced(server: LiveServer) -> None:
    """At temperature 1 on random weights: a json_schema answer parses and validates, a
    forced tool call names the tool with valid arguments, a bad schema is a 400."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    kwargs = {
        "model": MODEL, "temperature": 1.0, "max_tokens": 64, "seed": 3,
        "messages": [{"role": "user", "content": "Answer in JSON"}],
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    got = client.chat.completions.create(response_format=fmt, **kwargs)
    assert got.choices[0].finish_reason == "stop"
    document = json.loads(got.choices[0].message.content)
    assert isinstance(document["ok"], bool) and document["n"] in (1, 2, 3)
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    called = client.chat.completions.create(tools=[tool], tool_choice="required", **kwargs)
    (call,) = called.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "pick" and set(arguments) == {"ok", "n"}
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(response_format=bad, **kwargs)
    assert error.value.body["param"] == "response_format"


def test_a_steps_deltas_reach_each_event_loop_in_one_call() -> None:
    """The engine thread hands a step's deltas to an event loop in one
    call_soon_threadsafe (each one is a wake-up syscall and a GIL hand-over), and the loop
    side puts every delta into its own stream's queue in step order; a stream whose last
    choice finished is forgotten."""
    from types import SimpleNamespace

    from deltaserve.engine.async_engine import _Counters
    from deltaserve.engine.streaming import Stream
    from deltaserve.engine.types import RequestOutput

    class Loop:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def call_soon_threadsafe(self, fn: object, *args: object) -> None:
            self.calls.append((fn, args))

    loops = [Loop(), Loop()]
    queues = [asyncio.Queue() for _ in range(3)]
    streams = {
        f"r{i}": Stream(loops[min(i, 1)], queues[i], 1)  # type: ignore[arg-type]
        for i in range(3)
    }
    stub = SimpleNamespace(
        _streams=dict(streams),
        _open={k: 1 for k in streams},
        _counters=_Counters(),
        _deliver=None,
        engine=SimpleNamespace(platform=SimpleNamespace(stream_handoff=False)),
    )
    deltas = [
        RequestOutput("r1", 0, (5,)),
        RequestOutput("r0", 0, (7,)),
        RequestOutput("r2", 0, (8,), finish_reason="stop"),
        RequestOutput("r1", 0, (6,)),
        RequestOutput("gone", 0, (9,)),
    ]
    AsyncEngine._dispatch(stub, deltas)  # type: ignore[arg-type]
    assert [len(loop.calls) for loop in loops] == [1, 1]
    for loop in loops:
        fn, args = loop.calls[0]
        fn(*args)
    got = [[q.get_nowait().token_ids for _ in range(q.qsize())] for q in queues]
    assert got == [[(7,)], [(5,), (6,)], [(8,)]]
    assert "r2" not in stub._streams and stub._counters.generated_tokens == 5


def test_with_stream_handoff_streams_complete_and_equal_the_offline_engine() -> None:
    """stream_handoff (the engine thread waits for the event loop to write each step's
    tokens): concurrent streams all end with [DONE], and a greedy answer is the offline
    engine's, token for token."""
    config = dataclasses.replace(CONFIG, stream_handoff=True)
    with served_checkpoint("tiny", config, MODEL) as (engine, tokenizer, server):
        assert engine.engine.platform.stream_handoff

        async def one(client: httpx.AsyncClient, i: int) -> bool:
            body = {
                "model": MODEL,
                "stream": True,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"request {i} " * (1 + i % 5)}],
            }
            async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
                return "data: [DONE]" in [line async for line in r.aiter_lines()]

        async def run() -> list[bool]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(16)))

        assert all(asyncio.run(run()))
        _greedy_against_offline(server, engine, tokenizer, 16)
