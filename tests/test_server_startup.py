"""What `deltaserve serve` tells an operator at start-up: a taken port fails before the
model loads, loading says what it does, and the summary printed once the port is bound
states numbers that hold (resident memory as the process measures it, the row-state cap
as /metrics reports it, row counts that admission honours)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deltaserve.engine.api import EngineSummary
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.kernels.platform import Platform
from deltaserve.models.build import load_model
from deltaserve.models.testing import cached_checkpoint
from deltaserve.server.settings import ModelSettings, Settings
from deltaserve.server.startup import summary_lines
from tests.processes import SERVE

REPO = Path(__file__).resolve().parent.parent
READY = re.compile(r"ready: \S+ \(.*\) on (http://127\.0\.0\.1:(\d+)) \(api key off\)")
GIB = {"MiB": 2**20, "GiB": 2**30}


def _serve(*args: str, stderr: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [*SERVE, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with stderr.open("w") as err:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)


def _bytes(number: str, unit: str) -> float:
    return float(number) * GIB[unit]


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str, str]]:
    """The demo checkpoint served on --port 0; yields (pid, url, the start-up log)."""
    log = tmp_path_factory.mktemp("startup") / "stderr.log"
    proc = _serve("--model", str(cached_checkpoint("demo")), "--port", "0", stderr=log)
    try:
        deadline = time.monotonic() + 180
        while not (match := READY.search(log.read_text())) or "kv cache:" not in log.read_text():
            assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no start-up summary within 180 s"
            time.sleep(0.2)
        url = match.group(1)
        while True:  # the summary comes once the port is bound; uvicorn listens next
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield proc.pid, url, log.read_text()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_summary_resident_memory_is_the_process_rss(demo_server: tuple[int, str, str]) -> None:
    """The resident memory the summary states is within 2x of the process's RSS, and the
    weights it states are less than that (they are part of it)."""
    pid, _, log = demo_server
    match = re.search(r"weights ([\d.]+) (MiB|GiB), process resident ([\d.]+) (MiB|GiB) now", log)
    assert match, log
    weights, stated = _bytes(*match.group(1, 2)), _bytes(*match.group(3, 4))
    rss = _rss(pid)
    assert rss / 2 <= stated <= rss * 2, (stated, rss)
    assert weights < stated


def test_summary_budget_is_the_engine_cap(demo_server: tuple[int, str, str]) -> None:
    """The row-state budget is stated as a cap ("up to"), equal (to its rounding) to the
    budget /metrics reports, with nothing reserved and no row state held at start."""
    _, url, log = demo_server
    match = re.search(r"row state: up to ([\d.]+) (MiB|GiB) .*\((\d+) MiB reserved now\)", log)
    assert match, log
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    budget = float(re.search(r"^deltaserve_state_bytes_budget ([\d.e+]+)$", metrics, re.M)[1])
    in_use = float(re.search(r"^deltaserve_state_bytes_in_use ([\d.e+]+)$", metrics, re.M)[1])
    assert abs(_bytes(*match.group(1, 2)) - budget) <= 0.05 * budget
    assert match.group(3) == "0" and in_use == 0
    assert "prefix cache: up to" in log and "inside the row-state budget" in log


def test_loading_is_announced_before_the_summary(demo_server: tuple[int, str, str]) -> None:
    """Loading says what it loads and when it is done, before the summary."""
    log = demo_server[2]
    loading, loaded, ready = (log.index(s) for s in ("loading ", "model loaded in", "ready: "))
    assert loading < loaded < ready


def test_served_process_froze_its_start_up_heap(
    demo_server: tuple[int, str, str],
) -> None:
    """`deltaserve serve` says how many start-up objects it froze, and /metrics counts
    the collections it has run since (a chat request allocates enough for some)."""
    _, url, log = demo_server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    count = re.search(r'^deltaserve_gc_pause_seconds_count\{generation="0"\} (\S+)', metrics, re.M)
    assert count and float(count[1]) > 0
    match = re.search(r"heap: ([\d,]+) start-up objects frozen out of garbage collection", log)
    assert match and int(match[1].replace(",", "")) > 100_000, log[-2000:]


@pytest.mark.parametrize("launched", [False, True], ids=["alone", "under-mlx-launch"])
def test_taken_port_fails_before_the_model_loads(tmp_path: Path, launched: bool) -> None:
    """A port another process listens on: one error line naming it, exit 2, and the
    model was never loaded; also where mlx.launch's MLX_RANK defers the check to the
    bind that precedes loading (here a group of one)."""
    env = {"MLX_RANK": "0"} if launched else {}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "stderr.log"
        model = str(cached_checkpoint("demo"))
        proc = _serve("--model", model, "--port", str(port), stderr=log, env=env)
        assert proc.wait(timeout=120) == 2
    err = log.read_text()
    taken_line = f"cannot listen on 127.0.0.1:{port}: the port is already in use"
    assert f"deltaserve: error: {taken_line}" in err
    assert "loading" not in err and "Traceback" not in err


def test_summary_rows_are_what_admission_holds() -> None:
    """The summary's row counts are rows the budget admits: that many worst-case rows of a
    4,096-token chat (or of the full context) reserve, one more does not."""
    loaded = load_model(str(cached_checkpoint("tiny")))
    config = EngineConfig(max_context=16384, memory_budget_bytes=64 * 2**20)
    engine = LLMEngine(loaded, config)
    summary = engine.summary()
    assert summary.budget_bytes == 64 * 2**20 and summary.reserved_bytes == 0
    assert summary.chat_tokens == 4096 and summary.max_context == 16384
    assert summary.chat_rows > summary.context_rows > 0
    for rows, tokens in ((summary.chat_rows, 4096), (summary.context_rows, 16384)):
        budget = engine.budget
        for _ in range(rows):
            budget.reserve(budget.row_bytes(tokens))
        assert not budget.can_reserve(budget.row_bytes(tokens))
        budget.clear()
    assert engine.summary().prefix_cache_bytes == 32 * 2**20  # half the budget by default


def test_summary_lines_read_as_a_cap() -> None:
    """The summary states the budget as "up to", what is reserved now, the rows of a chat
    and of the full context, and how many run at once."""
    summary = EngineSummary(
        platform=Platform("cpu", "AMD EPYC", "float32", "0.31.1", "OpenBLAS (/lib/o.so)"),
        weight_bytes=512 * 2**20,
        budget_bytes=int(11.5 * 2**30),
        reserved_bytes=0,
        max_num_seqs=32,
        max_context=262144,
        chat_tokens=4096,
        chat_rows=1337,
        context_rows=23,
        prefix_cache_bytes=0,
    )
    settings = Settings(model=ModelSettings(path="/m/demo", served_name="deltaserve-demo"))
    lines = summary_lines(summary, settings, "http://127.0.0.1:8000", (1500 * 2**20, "now"))
    text = "\n".join(lines)
    assert lines[0] == "ready: deltaserve-demo (/m/demo) on http://127.0.0.1:8000 (api key off)"
    assert "weights 512 MiB, process resident 1.5 GiB now" in text
    assert "up to 11.5 GiB (half the memory left), allocated as requests arrive" in text
    assert "(0 MiB reserved now)" in text
    assert "room for 1,337 chats of 4,096 tokens or 23 of the full 262,144-token context" in text
    assert "32 run at once" in text and "prefix cache: off" in text


def test_connections_on_the_bound_socket_send_without_nagle_delay() -> None:
    """The socket bound before loading is a TCP socket to asyncio, so each accepted
    connection gets TCP_NODELAY (a stream's small SSE writes are not held back for the
    client's delayed ACK, ~40 ms each)."""
    import asyncio

    from deltaserve.server.cli import bind_socket
    from deltaserve.server.settings import ServerSettings

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = bind_socket(ServerSettings(host="127.0.0.1", port=0))
        server = await asyncio.start_server(on_connect, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0
