"""`deltaserve serve` as a real process (tiny checkpoint): a shutdown signal with token
streams open ends each stream with an OpenAI error event then [DONE] (and a waiting
non-streaming request with a 503), within about a second, without a traceback, and the
process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deltaserve.models.testing import cached_checkpoint
from tests.processes import free_port, wait_healthy

REPO = Path(__file__).resolve().parent.parent
NUM_STREAMS = 2


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """A `deltaserve serve` subprocess on a free port; yields (process, url, stderr file)."""
    port = free_port()
    command = [sys.executable, "-m", "deltaserve.server.cli", "serve", "--config", "/dev/null"]
    command += ["--model", str(cached_checkpoint("tiny")), "--port", str(port)]
    stderr_path = tmp_path / "stderr.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [(proc, stderr_path)])
        yield proc, url, stderr_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# No "model": the served name is derived from the path, and may be left out.
LONG_CHAT = {
    "max_tokens": 100_000,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Count forever."}],
}


def _stream_until_end(url: str, started: threading.Event, events: list[str]) -> None:
    """Open a long stream; set `started` once a token chunk came; collect its data lines."""
    body = {**LONG_CHAT, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) >= 2:  # past the role chunk: the engine is generating
                started.set()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_ends_open_streams_cleanly(
    server: tuple[subprocess.Popen, str, Path], signum: int
) -> None:
    """Each open stream ends with a 503 error event then [DONE]; exit 0 within ~3 s."""
    proc, url, stderr_path = server
    streams = [([], threading.Event()) for _ in range(NUM_STREAMS)]
    threads = [
        threading.Thread(target=_stream_until_end, args=(url, started, events), daemon=True)
        for events, started in streams
    ]
    waiting: list[httpx.Response] = []
    threads.append(
        threading.Thread(
            target=lambda: waiting.append(
                httpx.post(f"{url}/v1/chat/completions", json=LONG_CHAT, timeout=30)
            ),
            daemon=True,
        )
    )
    for thread in threads:
        thread.start()
    for _, started in streams:
        assert started.wait(60), "no token arrived"
    time.sleep(0.5)  # the non-streaming request is generating too by now
    sent = time.monotonic()
    proc.send_signal(signum)
    status = proc.wait(timeout=10)
    elapsed = time.monotonic() - sent
    for thread in threads:
        thread.join(5)
    stderr = stderr_path.read_text()
    assert status == 0, stderr
    assert elapsed < 3, f"shutdown took {elapsed:.1f} s"
    assert "Traceback" not in stderr, stderr
    for events, _ in streams:
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
        assert set(error) == {"message", "type", "param", "code"}
    assert waiting[0].status_code == 503
    assert waiting[0].json()["error"]["code"] == "server_shutting_down"
