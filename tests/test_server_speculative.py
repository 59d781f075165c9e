"""`--speculative mtp` over HTTP: the served engine drafts with the MTP head and gives the
same greedy text as without; /metrics counts its drafts; the flags parse."""

from __future__ import annotations

import dataclasses

import httpx
from fake_engine import served_checkpoint
from test_server_settings import parse

from deltaserve.engine.config import EngineConfig
from deltaserve.server.settings import load_settings

CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=32)
MODEL = "tiny-spec"


def _complete(url: str, prompt: list[int], speculative: bool = True) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "speculative": speculative}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return reply["choices"][0]["text"]


def test_speculative_flags_parse() -> None:
    """--speculative mtp --num-speculative-tokens 3 reach EngineConfig."""
    settings = load_settings(parse("--speculative", "mtp", "--num-speculative-tokens", "3"), {})
    assert settings.engine.speculative == "mtp"
    assert settings.engine.num_speculative_tokens == 3


def _structured(url: str, seed: int | None) -> str:
    """A chat whose answer must follow a JSON schema: greedy without thinking (the
    grammar from the first token), or sampled with a seed and thinking (the grammar
    from `</think>` on)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
              "n": {"type": "integer"}}, "required": ["name", "n"]}  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A name and a number."}],
            "max_tokens": 40, "temperature": 0.8 if seed is not None else 0, "seed": seed,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}},
            "chat_template_kwargs": {"enable_thinking": seed is not None}}  # fmt: skip
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    return reply["choices"][0]["message"]["content"]


def test_speculative_server_gives_the_same_greedy_text() -> None:
    """The same prompts through a plain and a speculating server: the same texts, for
    structured output (greedy and seeded) too; the speculating one reports drafted tokens
    on /metrics."""
    prompts = [[1000 + 37 * i + j for j in range(5 + 9 * i)] for i in range(3)]
    with served_checkpoint("tiny", CONFIG, MODEL) as (_, _, live):
        plain = [_complete(live.url, p) for p in prompts]
        plain += [_structured(live.url, None), _structured(live.url, 4)]
    spec = dataclasses.replace(CONFIG, speculative="mtp", num_speculative_tokens=2)
    with served_checkpoint("tiny", spec, MODEL) as (_, _, live):
        got = [_complete(live.url, p) for p in prompts]
        got += [_structured(live.url, None), _structured(live.url, 4)]
        metrics = httpx.get(f"{live.url}/metrics").text
    assert got == plain
    assert _drafted(metrics) > 0
    assert "deltaserve_speculative_break_even_drafts" in metrics


def test_a_request_with_speculative_false_does_not_draft() -> None:
    """`"speculative": false` in a request (our extension): its text is the plain one and
    the server's draft counter does not move."""
    prompt = [1000 + j for j in range(12)]
    with served_checkpoint("tiny", CONFIG, MODEL) as (_, _, live):
        plain = _complete(live.url, prompt)
    spec = dataclasses.replace(CONFIG, speculative="mtp", num_speculative_tokens=2)
    with served_checkpoint("tiny", spec, MODEL) as (_, _, live):
        assert _complete(live.url, prompt, speculative=False) == plain
        assert _drafted(httpx.get(f"{live.url}/metrics").text) == 0
        _complete(live.url, prompt)  # the same request allowed to: it drafts
        assert _drafted(httpx.get(f"{live.url}/metrics").text) > 0


def _drafted(metrics: str) -> float:
    lines = [
        line for line in metrics.splitlines()
        if line.startswith("deltaserve_speculative_drafted_tokens_total")
    ]  # fmt: skip
    assert lines, "no draft counter on /metrics"
    return float(lines[0].split()[-1])
