"""EngineProcess (engine/engine_process.py): the engine loop in a child process, behind the
same EngineClient as AsyncEngine. It streams what the in-process engine streams, its
errors cross the pipe as the server expects them, aborts and shutdown end streams and the
child, and a child that dies ends every stream with an error and reports a fault."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.engine.api import EngineStoppedError
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine_process import STATS_EVERY_S, EngineProcess
from deltaserve.engine.errors import InvalidRequestError
from deltaserve.engine.types import GenerationRequest, RequestOutput, SamplingParams
from deltaserve.models.testing import cached_checkpoint

CONFIG = EngineConfig(pipeline_steps=True, compile_decode=True)


@pytest.fixture(scope="module")
def engine() -> EngineProcess:
    process = EngineProcess.start(str(cached_checkpoint("tiny")), CONFIG, name="tiny")
    yield process
    process.shutdown()


def _requests() -> list[GenerationRequest]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True)
    return [
        GenerationRequest("a", (5, 6, 7, 8), greedy),
        GenerationRequest("b", tuple(range(100, 140)), seeded, n=2),
        GenerationRequest("c", (9, 10), greedy),
    ]


async def _collect(client: object, requests: list[GenerationRequest]) -> dict:
    async def one(request: GenerationRequest) -> list[tuple[int, tuple, str | None]]:
        return [(d.index, d.token_ids, d.finish_reason) async for d in client.generate(request)]

    results = await asyncio.gather(*(one(r) for r in requests))
    return {
        r.request_id: sorted(out, key=lambda d: d[0])
        for r, out in zip(requests, results, strict=True)
    }


def _tokens(out: list[tuple[int, tuple, str | None]]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for index, ids, _ in out:
        tokens.setdefault(index, []).extend(ids)
    return tokens


def test_it_streams_what_the_in_process_engine_streams(engine: EngineProcess) -> None:
    """Greedy, seeded and n=2 requests at once: the same tokens and finish reasons as
    AsyncEngine on the same checkpoint and config; the child's stats reach the server."""
    ours = asyncio.run(_collect(engine, _requests()))
    alone = AsyncEngine.start(str(cached_checkpoint("tiny")), CONFIG, name="tiny")
    try:
        theirs = asyncio.run(_collect(alone, _requests()))
    finally:
        alone.shutdown()
    for rid in theirs:
        assert _tokens(ours[rid]) == _tokens(theirs[rid]), rid
        ends = sorted(f for _, _, f in ours[rid] if f)
        assert ends == sorted(f for _, _, f in theirs[rid] if f), rid
    assert len(_tokens(ours["b"])) == 2 and len(_tokens(ours["a"])[0]) == 12
    deadline = time.monotonic() + 5
    while engine.stats().generated_tokens_total < 12 + 2 * 9 + 12:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)
    assert engine.stats().is_alive and engine.summary().max_context == engine.max_context


def test_a_rejected_request_raises_the_engines_error(engine: EngineProcess) -> None:
    """A request the engine refuses raises its InvalidRequestError (with `param`) from
    generate, before any delta, as AsyncEngine's does."""
    too_long = GenerationRequest(
        "long", (1,) * 8, SamplingParams(max_tokens=engine.max_context + 1)
    )

    async def run() -> None:
        async for _ in engine.generate(too_long):
            pytest.fail("a refused request streamed")

    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(run())
    assert refused.value.param == "max_tokens"


def test_closing_a_stream_aborts_its_request(engine: EngineProcess) -> None:
    """A client gone mid-stream: its row is freed in the child (running rows back to 0)."""
    endless = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)

    async def run() -> None:
        stream = engine.generate(GenerationRequest("gone", (5, 6, 7), endless))
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break
        await stream.aclose()

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while engine.stats().num_running:
        assert time.monotonic() < deadline, "the aborted row still runs"
        time.sleep(0.05)


def _stream_until(client: EngineProcess, act: object) -> list[RequestOutput]:
    """Stream an endless request; after its third delta call `act()` (in a thread) and
    keep reading until the stream ends."""
    endless = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)

    async def run() -> list[RequestOutput]:
        deltas = []
        async for delta in client.generate(GenerationRequest("open", (5, 6, 7), endless)):
            deltas.append(delta)
            if len(deltas) == 3:
                asyncio.get_running_loop().run_in_executor(None, act)
        return deltas

    return asyncio.run(asyncio.wait_for(run(), 60))


def _assert_refuses(client: EngineProcess) -> None:
    """A new request gets EngineStoppedError (HTTP 503) before any delta."""

    async def late() -> None:
        async for _ in client.generate(GenerationRequest("late", (1, 2), SamplingParams())):
            pytest.fail("a stopped engine streamed")

    with pytest.raises(EngineStoppedError):
        asyncio.run(late())


def test_shutdown_ends_open_streams_and_the_child() -> None:
    """shutdown() with a stream open: the stream ends ("abort"), the child exits 0, a
    second shutdown() is a no-op, and later requests get EngineStoppedError."""
    client = EngineProcess.start(str(cached_checkpoint("tiny")), CONFIG, name="tiny")
    deltas = _stream_until(client, client.shutdown)
    assert deltas[-1].finish_reason == "abort"
    client.shutdown()
    assert client._process.exitcode == 0 and client.fault is None
    assert not client.stats().is_alive
    _assert_refuses(client)


def test_a_dead_child_ends_streams_with_an_error_and_reports_a_fault() -> None:
    """The child killed mid-stream: the stream ends with finish_reason "error", the fault
    names the exit, on_fault tells the server (which exits 1), /health's is_alive turns
    false and new requests get EngineStoppedError (HTTP 503)."""
    client = EngineProcess.start(str(cached_checkpoint("tiny")), CONFIG, name="tiny")
    faults: list[str] = []
    client.on_fault = faults.append
    try:
        deltas = _stream_until(client, lambda: os.kill(client._process.pid, signal.SIGKILL))
        assert deltas[-1].finish_reason == "error" and "takes no requests" in deltas[-1].error
        assert faults and "exited (exit code -9)" in faults[0] and client.fault == faults[0]
        assert not client.stats().is_alive
        _assert_refuses(client)
    finally:
        client.shutdown()


def test_a_request_cancelled_before_its_answer_is_aborted(engine: EngineProcess) -> None:
    """A client that leaves before the child answered its add: the reader does not fail
    on the cancelled acceptance, the child aborts the request (running rows back to 0),
    and the next request is served."""
    endless = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)

    async def run() -> list[int]:
        async def consume() -> None:
            async for _ in engine.generate(GenerationRequest("left", (5, 6, 7), endless)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # it sent the add and waits for the answer
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # the answer came back to a cancelled future
        deadline = time.monotonic() + 10
        while engine.stats().num_running:
            assert time.monotonic() < deadline, "the cancelled request still runs"
            await asyncio.sleep(0.05)
        request = GenerationRequest("after", (1, 2, 3), SamplingParams(max_tokens=3))
        return [t async for d in engine.generate(request) for t in d.token_ids]

    assert len(asyncio.run(asyncio.wait_for(run(), 30))) == 3
    assert engine._reader.is_alive()


def test_the_server_over_http_through_the_engine_process() -> None:
    """The HTTP app on an EngineProcess: /v1/completions greedy text equals the offline
    engine's on the same checkpoint, a streamed chat ends with finish_reason, /health is
    ok and /metrics counts the child's generated tokens."""
    from fake_engine import LiveServer

    from deltaserve.engine.engine import LLMEngine
    from deltaserve.models.build import load_model
    from deltaserve.server.app import create_app
    from deltaserve.server.frontend.tokenizer import TextTokenizer
    from deltaserve.server.settings import ModelSettings, ServerSettings, Settings

    path = cached_checkpoint("tiny")
    client = EngineProcess.start(str(path), CONFIG, name="tiny")
    tokenizer = TextTokenizer(client.model_path, client.eos_token_ids)
    settings = Settings(
        model=ModelSettings(path=str(path), served_name="tiny"),
        server=ServerSettings(keepalive=1.0, engine_process=True),
    )
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    with LiveServer(create_app(client, tokenizer, settings)) as live:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        got = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=chat) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        assert httpx.get(f"{live.url}/health").status_code == 200
        time.sleep(2 * STATS_EVERY_S)  # the child's next snapshot
        metrics = httpx.get(f"{live.url}/metrics").text
    assert client._process.exitcode == 0  # the app's shutdown stopped the child
    offline = LLMEngine(load_model(str(path)), CONFIG).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )[0]
    visible = [t for t in offline.token_ids if t not in tokenizer.hidden_token_ids]
    assert got["choices"][0]["text"] == tokenizer.decode(visible)
    assert '"finish_reason":"length"' in lines[-1].replace(" ", "")
    generated = [
        line
        for line in metrics.splitlines()
        if line.startswith("deltaserve_generat") and "_total" in line
    ]
    assert len(generated) == 1 and float(generated[0].split()[-1]) >= 16 + 5, generated


def _maps_mlx(pid: int) -> bool:
    """Whether process `pid` has MLX's library mapped (it imported mlx.core)."""
    return "libmlx" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux's /proc")
def test_the_servers_own_process_never_loads_mlx() -> None:
    """`deltaserve serve --engine-process` after a chat: MLX is loaded in the engine's
    process and not in the server's (on CUDA a process that loads MLX holds a device
    context of its own)."""
    from bench.server_vs_mlxlm import _free_port as free_port
    from bench.stop_check import serve_command, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--engine-process", "--max-num-seqs", "2"]
    command = serve_command(str(cached_checkpoint("tiny")), port, flags)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile("w+") as log:  # a pipe nobody reads could fill and block it
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(url, proc, 180)
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4}  # fmt: skip
            answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
            assert answer.status_code == 200
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert any(_maps_mlx(int(pid)) for pid in children), children  # the engine's
            assert not _maps_mlx(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                status = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        log.seek(0)
        assert status == 0, log.read()[-2000:]
