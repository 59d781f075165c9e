"""The status page in a real browser: Debian's headless Chromium, driven by Playwright,
opens /dashboard of a `deltaserve serve` process (tiny checkpoint, an API key set) while
chat requests run, and the page's numbers move with them.

Chromium comes from Debian (`apt-get install chromium`, .ci/run does it), never from
`playwright install`; without it this test fails, it does not skip. DASHBOARD_SCREENSHOT=
PATH saves the page's screenshot there (README's docs/dashboard.png was made so).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from tests.processes import serve_tiny

CHROMIUM = Path("/usr/bin/chromium")
API_KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_SHORT_CHATS = 3
SHORT_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A `deltaserve serve` process with an API key; yields (url, its stderr log)."""
    log = tmp_path_factory.mktemp("dashboard") / "stderr.log"
    with serve_tiny(log, "--api-key", API_KEY, "--served-model-name", "tiny") as (_, url):
        yield url, log


def _chat(url: str, max_tokens: int) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text


def _leave_long_stream(url: str, has_started: threading.Event, done: threading.Event) -> None:
    """Stream a long chat until `done` is set, then hang up (the client goes away)."""
    body = {
        "model": "tiny",
        "stream": True,
        "messages": [{"role": "user", "content": "Count forever."}],
        "max_tokens": 100_000,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120
    ) as reply:
        for _ in reply.iter_lines():
            has_started.set()
            if done.is_set():
                return


def _number(page: Page, element_id: str) -> int:
    return int(page.locator(f"#{element_id}").inner_text())


def _wait_number(page: Page, element_id: str, at_least: int) -> None:
    """Until the page shows at least `at_least` in #element_id (it polls each second)."""
    page.wait_for_function(
        "([id, n]) => Number(document.getElementById(id).textContent) >= n",
        arg=[element_id, at_least],
        timeout=60_000,
    )


def test_dashboard_numbers_move_while_chats_run(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a stream runs the page shows a running row; after it is dropped and short
    chats finish, the finished count and generated tokens have risen, the last-requests
    table holds one row per request (the dropped one says the client went away), the
    throughput chart has a line, and each request wrote one log line."""
    url, log = server
    assert CHROMIUM.is_file(), "no /usr/bin/chromium: `apt-get install -y chromium`"
    # pytest runs with OpenBLAS in LD_PRELOAD (tests/conftest.py); Playwright's node
    # driver and Chromium inherit it and then fail to start their threads.
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--disable-gpu", "--disable-dev-shm-usage"]
        )
        # The key as HTTP Basic's password: how a person's browser logs in to the page.
        credentials = {"username": "operator", "password": API_KEY}
        context = browser.new_context(
            http_credentials=credentials, viewport={"width": 1200, "height": 900}
        )
        page = context.new_page()
        assert page.goto(f"{url}/dashboard").status == 200
        page.wait_for_function("document.getElementById('finished').textContent === '0'")
        assert _number(page, "generated") == 0
        assert page.locator("#requests tbody tr").count() == 0

        has_started, done = threading.Event(), threading.Event()
        stream = threading.Thread(target=_leave_long_stream, args=(url, has_started, done))
        stream.start()
        assert has_started.wait(60)
        _wait_number(page, "running", 1)
        done.set()
        stream.join(60)

        chats = [
            threading.Thread(target=_chat, args=(url, SHORT_TOKENS)) for _ in range(NUM_SHORT_CHATS)
        ]
        for chat in chats:
            chat.start()
        for chat in chats:
            chat.join(120)
        _wait_number(page, "finished", NUM_SHORT_CHATS + 1)
        _wait_number(page, "generated", NUM_SHORT_CHATS * SHORT_TOKENS)
        page.wait_for_function(
            "document.querySelector('#chart-throughput polyline').getAttribute('points') !== ''"
        )

        rows = page.locator("#requests tbody tr")
        assert rows.count() == NUM_SHORT_CHATS + 1
        texts = [rows.nth(i).inner_text() for i in range(rows.count())]
        assert sum("client went away" in text for text in texts) == 1
        short = [text.split("\t") for text in texts if "length" in text]
        assert len(short) == NUM_SHORT_CHATS
        for cells in short:
            assert cells[2] == "chat" and cells[5] == str(SHORT_TOKENS), cells
        assert page.locator("#platform").inner_text().count("cpu") >= 1
        assert re.search(r"decode [1-9]\d* x \d+\.\d ms", page.locator("#steps").inner_text())

        target = os.environ.get("DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
        assert page.screenshot(path=target)[:8] == b"\x89PNG\r\n\x1a\n"
        browser.close()

    lines = [line for line in log.read_text().splitlines() if "deltaserve.requests" in line]
    assert len(lines) == NUM_SHORT_CHATS + 1, lines
    # the dropped stream may have written any count, SHORT_TOKENS too, before it went
    finished = [line for line in lines if line.endswith("finish=length")]
    assert len(finished) == NUM_SHORT_CHATS
    assert all(f"completion={SHORT_TOKENS} " in line for line in finished), finished
    assert sum(line.endswith("finish=client went away") for line in lines) == 1
