"""Each protocol's thinking budget field reaches the engine as SamplingParams'
max_thinking_tokens (with the tokenizer's "\\n</think>\\n\\n"): chat's max_thinking_tokens
and reasoning_effort, Anthropic's thinking.budget_tokens, Responses' reasoning.effort.
Live uvicorn + FakeEngine (1024-token context)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, live_fake_server

from deltaserve.engine.types import SamplingParams
from deltaserve.server.schemas import effort_thinking_tokens
from deltaserve.server.settings import ModelSettings, SamplingDefaults, Settings

MODEL = "qwen-test"
USER = [{"role": "user", "content": "hi"}]
SETTINGS = Settings(
    model=ModelSettings(path="unused", served_name=MODEL),
    sampling=SamplingDefaults(max_tokens=512),
)

engine, server, http = live_fake_server(SETTINGS)


def _post(http: httpx.Client, path: str, status: int = 200, **fields: Any) -> dict[str, Any]:
    response = http.post(path, json={"model": MODEL, **fields})
    assert response.status_code == status, response.text
    return {} if fields.get("stream") else response.json()


def _chat(http: httpx.Client, status: int = 200, **fields: Any) -> dict[str, Any]:
    return _post(http, "/v1/chat/completions", status, messages=USER, **fields)


def _budget(engine: FakeEngine) -> int | None:
    params: SamplingParams = engine.requests[-1].params
    if params.max_thinking_tokens is not None:
        tokenizer = engine.tokenizer
        assert params.thinking_close_ids == tokenizer.thinking_close_ids
        assert tokenizer.decode(list(params.thinking_close_ids)) == "\n</think>\n\n"
        assert params.thinking_end_id == tokenizer.think_end_id
    return params.max_thinking_tokens


def test_effort_budgets() -> None:
    """minimal 256, low 1024, medium 4096, the rest unlimited; none once max_tokens is no
    larger than the budget."""
    budgets = {e: effort_thinking_tokens(e, 10_000) for e in ("minimal", "low", "medium")}
    assert budgets == {"minimal": 256, "low": 1024, "medium": 4096}
    assert effort_thinking_tokens("high", 10_000) is None
    assert effort_thinking_tokens(None, 10_000) is None
    assert effort_thinking_tokens("low", 1024) is None


def test_chat_max_thinking_tokens(http: httpx.Client, engine: FakeEngine) -> None:
    """Chat's extension is the budget (streaming too), wins over reasoning_effort's, means
    nothing with thinking off, is unlimited when absent, and must be >= 0."""
    _chat(http, max_thinking_tokens=5)
    assert _budget(engine) == 5
    _chat(http, max_thinking_tokens=0, stream=True)
    assert _budget(engine) == 0
    _chat(http, max_thinking_tokens=7, reasoning_effort="minimal")
    assert _budget(engine) == 7
    _chat(http, max_thinking_tokens=5, chat_template_kwargs={"enable_thinking": False})
    assert _budget(engine) is None
    _chat(http)
    assert _budget(engine) is None
    error = _chat(http, 400, max_thinking_tokens=-1)["error"]
    assert error["param"] == "max_thinking_tokens"


def test_chat_reasoning_effort_budget(http: httpx.Client, engine: FakeEngine) -> None:
    """reasoning_effort sets its budget when max_tokens leaves room for it."""
    _chat(http, reasoning_effort="minimal")  # max_tokens 512 (the default)
    assert _budget(engine) == 256
    _chat(http, reasoning_effort="low")  # 1024 >= 512: the length limit comes first
    assert _budget(engine) is None


def test_budget_with_a_constraint_starts_the_grammar_at_the_close(
    http: httpx.Client, engine: FakeEngine
) -> None:
    """With thinking on the grammar starts after `</think>`, the token the budget forces."""
    _chat(http, max_thinking_tokens=3, response_format={"type": "json_object"})
    params = engine.requests[-1].params
    assert params.constraint is not None and _budget(engine) == 3
    assert params.constraint.start_after_token_id == params.thinking_end_id


def test_anthropic_budget_tokens(http: httpx.Client, engine: FakeEngine) -> None:
    """thinking enabled's budget_tokens is the budget; adaptive's and disabled's are not."""
    fields = {"messages": USER, "max_tokens": 64}
    for thinking, budget in [
        ({"type": "enabled", "budget_tokens": 40}, 40),
        ({"type": "enabled"}, None),
        ({"type": "adaptive", "budget_tokens": 40}, None),
        ({"type": "disabled", "budget_tokens": 40}, None),
    ]:
        _post(http, "/v1/messages", thinking=thinking, **fields)
        assert _budget(engine) == budget, thinking
    bad = {"type": "enabled", "budget_tokens": -1}
    error = _post(http, "/v1/messages", 400, thinking=bad, **fields)["error"]
    assert "budget_tokens" in error["message"]


@pytest.mark.parametrize(
    ("reasoning", "max_output_tokens", "budget"),
    [
        ({"effort": "minimal"}, 512, 256),
        ({"effort": "low"}, 512, None),
        ({"effort": "high"}, 512, None),
        ({"effort": "none"}, 512, None),
        ({}, None, None),
    ],
)
def test_responses_reasoning_effort(
    http: httpx.Client,
    engine: FakeEngine,
    reasoning: dict[str, str],
    max_output_tokens: int | None,
    budget: int | None,
) -> None:
    """reasoning.effort's budget, unless max_output_tokens is no larger."""
    limit = {} if max_output_tokens is None else {"max_output_tokens": max_output_tokens}
    _post(http, "/v1/responses", input="hi", reasoning=reasoning, **limit)
    assert _budget(engine) == budget
