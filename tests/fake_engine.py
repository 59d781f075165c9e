"""Support for the server tests: a scripted EngineClient, the real tokenizer, a live
uvicorn in a thread, and response validation against the OpenAI OpenAPI spec.

FakeEngine behaves like deltaserve.engine.async_engine.AsyncEngine at the boundary: `generate()` is
an async generator that refuses (InvalidRequestError / QueueFullError) on its first
read, then streams one token per choice per step; closing it aborts. It emits the token
ids of a scripted text via the real Qwen3.5 tokenizer, then EOS, honouring max_tokens,
ignore_eos, n, logprobs and abort. It can be told to refuse the next request, to end a
request with finish_reason "error", or to raise mid-stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from openapi_schema_validator import OAS31Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from deltaserve.engine.api import EngineInfo, EngineStats
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.types import GenerationRequest, RequestOutput, TokenLogprob
from deltaserve.kernels.platform import Platform
from deltaserve.models.eos import resolve_eos_ids
from deltaserve.models.testing import cached_checkpoint
from deltaserve.server.app import create_app
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.settings import ModelSettings, SamplingDefaults, ServerSettings, Settings

REPO = Path(__file__).resolve().parent.parent
SPEC_PATH = Path("/work/shared/reference/openai-openapi.yaml")
THINKING_SCRIPT = "The user greets me.\n</think>\n\nHello! How can I help you today?"
PLAIN_SCRIPT = " Paris is the capital of France."


@functools.lru_cache(maxsize=1)
def real_tokenizer() -> TextTokenizer:
    """The real Qwen3.5 tokenizer (rebuilt offline), cached on disk under .cache/."""
    from deltaserve.models.testing.tokenizer import write_tokenizer

    target = REPO / ".cache" / "test-tokenizer-qwen35"
    if not (target / "tokenizer.json").is_file():
        staging = target.with_name(f"{target.name}.{os.getpid()}")
        write_tokenizer(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: concurrent test runs never see half a directory
    return TextTokenizer(target, resolve_eos_ids(target))


def default_script(tokenizer: TextTokenizer, request: GenerationRequest) -> str:
    """Chat prompts that open <think> get reasoning then an answer; others plain text."""
    tail = tokenizer.decode(list(request.prompt_ids[-3:]))
    return THINKING_SCRIPT if tail.endswith("<think>\n") else PLAIN_SCRIPT


class FakeEngine:
    """A deterministic EngineClient (see the module docstring)."""

    def __init__(self, tokenizer: TextTokenizer, max_context: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_token_ids = tokenizer.eos_token_ids
        self.eos_id = tokenizer.eos_token_ids[0]
        fake = Platform("cpu", dtype="float32", mlx_version="0.0-fake", blas="fake BLAS")
        self.info = EngineInfo(fake, max_num_batched_tokens=512)
        self.script: Callable[[GenerationRequest], str] = functools.partial(
            default_script, tokenizer
        )
        self.token_delay = 0.0  # seconds between steps
        self.first_token_delay = 0.0  # "prefill" time before the first token
        self.refuse_next: BaseException | None = None  # raised on the next submit
        self.error_after: int | None = None  # finish "error" after this many steps
        self.raise_after: int | None = None  # raise RuntimeError after this many steps
        self.is_alive = True
        self.requests: list[GenerationRequest] = []  # every accepted request, in order
        self.aborted: list[str] = []
        self.num_shutdowns = 0
        self._abort_flags: dict[str, bool] = {}

    def reset(self) -> None:
        """Back to the scripted defaults (tests share one engine per module)."""
        self.__init__(self.tokenizer, self.max_context)  # type: ignore[misc]

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        await asyncio.sleep(0)  # "the engine thread drains its inbox"
        if self.refuse_next is not None:
            error, self.refuse_next = self.refuse_next, None
            raise error
        self.requests.append(request)
        self._abort_flags[request.request_id] = False
        open_choices = set(range(request.n))
        try:
            await asyncio.sleep(self.first_token_delay)
            ids = self.tokenizer.encode(self.script(request))
            step = 0
            while open_choices:
                if self._abort_flags[request.request_id]:
                    for i in sorted(open_choices):
                        yield self._output(request, i, (), step, "abort")
                    open_choices.clear()
                    break
                if self.raise_after is not None and step >= self.raise_after:
                    raise RuntimeError("fake engine crashed")
                for i in sorted(open_choices):
                    output = self._step(request, i, ids, step)
                    if output.finished:
                        open_choices.discard(i)
                    yield output
                step += 1
                await asyncio.sleep(self.token_delay)
        finally:
            if open_choices:  # the caller closed us early: like AsyncEngine, abort
                self.abort(request.request_id)
            self._abort_flags.pop(request.request_id, None)

    def _step(
        self, request: GenerationRequest, index: int, ids: list[int], step: int
    ) -> RequestOutput:
        params = request.params
        if self.error_after is not None and step >= self.error_after:
            return self._output(request, index, (), step, "error", error="fake step failed")
        if step < len(ids):
            token = ids[step]
        elif params.ignore_eos:
            token = ids[step % len(ids)]
        else:
            token = self.eos_id
        count = step + 1
        reason = None
        if token == self.eos_id:
            reason = "stop"
        elif count >= params.max_tokens or len(request.prompt_ids) + count >= self.max_context:
            reason = "length"
        return self._output(request, index, (token,), count, reason)

    def _output(
        self,
        request: GenerationRequest,
        index: int,
        tokens: tuple[int, ...],
        count: int,
        reason: str | None,
        error: str | None = None,
    ) -> RequestOutput:
        logprobs = None
        if request.params.logprobs:
            top_k = request.params.top_logprobs
            alternatives = [(t, -0.25) for t in tokens] + [(15 + k, -2.0 - k) for k in range(20)]
            logprobs = tuple(TokenLogprob(t, -0.25, tuple(alternatives[:top_k])) for t in tokens)
        return RequestOutput(
            request.request_id,
            index,
            tokens,
            logprobs=logprobs,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=count,
        )

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self._abort_flags:
            self._abort_flags[request_id] = True

    def stats(self) -> EngineStats:
        return EngineStats(
            is_alive=self.is_alive,
            num_waiting=0,
            num_running=len(self._abort_flags),
            state_bytes_in_use=1234,
            state_bytes_budget=1 << 30,
            kv_bytes_per_token=4096,
            mlx_active_bytes=5678,
            mlx_peak_bytes=9999,
            prompt_tokens_total=sum(len(r.prompt_ids) for r in self.requests),
            generated_tokens_total=0,
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        self.num_shutdowns += 1
        self.is_alive = False


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.port = 0
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self._thread is not None
        self._thread.join(10)


def live_fake_server(settings: Settings, headers: dict[str, str] | None = None) -> tuple:
    """A test module's fixtures for the real app over a FakeEngine: `engine` and `server`
    (uvicorn), one each per module, and `http`, a client per test (`headers` on every
    request) after the engine was reset. Bind them by those names:
    `engine, server, http = live_fake_server(SETTINGS)`."""

    @pytest.fixture(scope="module")
    def engine() -> FakeEngine:
        return FakeEngine(real_tokenizer(), max_context=1024)

    @pytest.fixture(scope="module")
    def server(engine: FakeEngine) -> Iterator[LiveServer]:
        with LiveServer(create_app(engine, real_tokenizer(), settings)) as live:
            yield live

    @pytest.fixture
    def http(server: LiveServer, engine: FakeEngine) -> Iterator[httpx.Client]:
        engine.reset()
        with httpx.Client(base_url=server.url, timeout=30, headers=headers) as client:
            yield client

    return engine, server, http


@functools.lru_cache(maxsize=1)
def openapi_spec() -> dict[str, Any]:
    """The OpenAI spec (3 MB, parsed once), with OpenAPI 3.0 `nullable: true` rewritten
    as JSON Schema's `{"anyOf": [..., {"type": "null"}]}`: the file mixes both styles and
    the 3.1 validator understands only the latter."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with SPEC_PATH.open() as f:
        return _nullable_to_anyof(yaml.load(f, Loader=loader))


def _nullable_to_anyof(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable_to_anyof(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable_to_anyof(value) for key, value in node.items()}
    if node.get("nullable") is True:  # (a property *named* nullable holds a dict)
        del node["nullable"]
        return {"anyOf": [node, {"type": "null"}]}
    return node


def spec_errors(schema_name: str, instance: Any) -> list[str]:
    """Messages of every way `instance` violates components/schemas/<schema_name>."""
    schema = {"$ref": f"urn:openai#/components/schemas/{schema_name}"}
    validator = OAS31Validator(schema, registry=_spec_registry())
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(instance)
    ]


@functools.lru_cache(maxsize=1)
def _spec_registry() -> Registry:
    resource = Resource.from_contents(openapi_spec(), default_specification=DRAFT202012)
    return Registry().with_resource("urn:openai", resource)


def parse_sse(body: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" kept as the string)."""
    events = []
    for block in body.decode().split("\n\n"):
        match = re.fullmatch(r"data: (.*)", block, flags=re.S)
        if match:
            payload = match.group(1)
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@contextmanager
def served_checkpoint(
    shape: str, config: EngineConfig, name: str
) -> Iterator[tuple[AsyncEngine, TextTokenizer, LiveServer]]:
    """The real engine on a cached test checkpoint, served over HTTP (served as `name`,
    1 s keepalive, default sampling); stopped on exit."""
    engine = AsyncEngine.start(str(cached_checkpoint(shape)), config, name=name)
    try:
        tokenizer = TextTokenizer(engine.model_path, engine.eos_token_ids)
        settings = Settings(
            model=ModelSettings(path=str(engine.model_path), served_name=name),
            server=ServerSettings(keepalive=1.0),
            sampling=SamplingDefaults(),
        )
        with LiveServer(create_app(engine, tokenizer, settings)) as live:
            yield engine, tokenizer, live
    finally:
        engine.shutdown()
