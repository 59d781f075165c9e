"""/v1/messages on the real engine (tiny peaked checkpoint) through the `anthropic` SDK:
greedy answers equal the OpenAI chat route's for the same conversation, streaming equals
non-streaming, <|im_end|> ends the turn (end_turn), a tools round trip's history renders
and runs, and usage reports the prefix cache as cache_read_input_tokens."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from fake_engine import LiveServer

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.models.chat_format import IM_END_ID
from deltaserve.models.testing import cached_checkpoint
from deltaserve.server.app import create_app
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.settings import ModelSettings, SamplingDefaults, ServerSettings, Settings

MODEL = "tiny"
CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_prefill_chunk=128)
USER = {"role": "user", "content": "Tell me about the weather."}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = AsyncEngine.start(str(cached_checkpoint("tiny")), CONFIG, name=MODEL)
    tokenizer = TextTokenizer(engine.model_path, engine.eos_token_ids)
    settings = Settings(
        model=ModelSettings(path=str(engine.model_path), served_name=MODEL),
        server=ServerSettings(keepalive=1.0),
        sampling=SamplingDefaults(),
    )
    try:
        with LiveServer(create_app(engine, tokenizer, settings)) as live:
            yield live
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def sdk(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_greedy_message_equals_chat_and_stream(
    server: LiveServer, sdk: anthropic.Anthropic
) -> None:
    """Greedy: thinking + text of /v1/messages == reasoning + content of the chat route;
    the streamed message accumulates to the same blocks."""
    # This SDK has no temperature argument (newer models fix it); the server takes it.
    kwargs = {"model": MODEL, "max_tokens": 12, "messages": [USER]}
    extra = {"ignore_eos": True, "temperature": 0}
    message = sdk.messages.create(**kwargs, system="Answer briefly.", extra_body=extra)
    with sdk.messages.stream(**kwargs, system="Answer briefly.", extra_body=extra) as stream:
        streamed = stream.get_final_message()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    system = {"role": "system", "content": "Answer briefly."}
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, extra_body=extra, messages=[system, USER]
    )
    answer = chat.choices[0].message
    text = {block.type: getattr(block, block.type) for block in message.content}
    assert text.get("thinking", "") == (answer.reasoning_content or "")
    assert text.get("text", "") == (answer.content or "")
    assert [b.model_dump(include={"type", "text", "thinking"}) for b in streamed.content] == [
        b.model_dump(include={"type", "text", "thinking"}) for b in message.content
    ]
    assert message.stop_reason == streamed.stop_reason == "max_tokens"
    assert message.usage.output_tokens == streamed.usage.output_tokens == 12


def test_im_end_is_end_turn(sdk: anthropic.Anthropic) -> None:
    """<|im_end|> (pushed up by logit_bias, no ignore_eos) ends the turn: end_turn."""
    message = sdk.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=[USER],
        extra_body={"logit_bias": {str(IM_END_ID): 100}, "temperature": 0},
    )
    assert message.stop_reason == "end_turn" and message.usage.output_tokens < 16


def test_tool_history_runs_and_resend_reads_the_cache(sdk: anthropic.Anthropic) -> None:
    """A conversation with tool_use and tool_result renders and runs; sent again, its
    history comes from the prefix cache (cache_read_input_tokens), and count_tokens
    equals input_tokens + cache_read_input_tokens."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold " * 700}
    messages = [
        USER,
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call]},
        {"role": "user", "content": [result]},
    ]
    kwargs = {"model": MODEL, "messages": messages, "tools": [WEATHER]}
    greedy = {"temperature": 0}
    first = sdk.messages.create(max_tokens=4, extra_body=greedy, **kwargs)
    again = sdk.messages.create(max_tokens=4, extra_body=greedy, **kwargs)
    count = sdk.messages.count_tokens(**kwargs).input_tokens
    assert first.usage.cache_read_input_tokens == 0
    assert 0 < again.usage.cache_read_input_tokens < count
    for usage in (first.usage, again.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == count
