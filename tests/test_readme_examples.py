"""Every example in README.md works as written: each ```bash block that calls the server
and each ```python block runs, unchanged but for the port, against a live server on the
demo checkpoint under the name scripts/setup serves, and every answer it gets is
non-empty. The blocks that are not run (set-up commands, other machines) are named in
NOT_RUN with the reason, and each name must still match a block."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from image_samples import picture

from deltaserve.models.testing import cached_checkpoint
from tests.processes import free_port, wait_healthy

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
README_PORT = "127.0.0.1:8000"
# The name README's examples send is the one scripts/setup serves every checkpoint as.
SETUP = (REPO / "scripts/setup").read_text()
SERVED_NAME = re.search(r'set -- "\$@" --served-model-name (\S+)$', SETUP, re.M)[1]

# First command line of each block that is not run here -> why.
NOT_RUN = {
    "scripts/setup": "starts the server itself; the fixture serves as it does",
    "bash .ci/run": "CI itself: installs everything and runs this suite",
    "scripts/setup --model Qwen/Qwen3.5-9B": "downloads and serves real checkpoints",
    "pip install openai anthropic": "installs the SDKs; the test extra already has them",
    "mlx.launch --backend ring --hosts mac1.local,mac2.local": "needs several hosts or GPUs",
    ".venv/bin/python -m bench.single_stream --checkpoint small": "benchmarks: minutes each",
}


def readme_blocks() -> list[tuple[str, int, str]]:
    """(language, line number, code) of every ```bash and ```python block."""
    blocks = []
    for match in re.finditer(r"^```(bash|python)\n(.*?)^```", README, flags=re.S | re.M):
        line = README.count("\n", 0, match.start()) + 1
        blocks.append((match.group(1), line, match.group(2)))
    return blocks


def first_command(code: str) -> str:
    """The block's first line that is not blank or a comment, without its comment."""
    lines = (line.split(" #")[0].rstrip(" \\") for line in code.splitlines())
    return next(line.strip() for line in lines if line.strip() and not line.startswith("#"))


BLOCKS = readme_blocks()
RUN = [block for block in BLOCKS if first_command(block[2]) not in NOT_RUN]


def test_every_skipped_example_is_still_in_the_readme() -> None:
    """Each NOT_RUN entry names exactly one README block (the list cannot go stale), and
    the rest, the examples that are run, call the server."""
    heads = [first_command(code) for _, _, code in BLOCKS]
    assert sorted(head for head in heads if head in NOT_RUN) == sorted(NOT_RUN)
    assert len(RUN) >= 7
    for lang, line, code in RUN:
        assert README_PORT in code, f"README line {line}: a {lang} example that calls no server"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`deltaserve serve` on the demo checkpoint as scripts/setup starts it; yields the
    host:port that replaces README's."""
    port = free_port()
    log = tmp_path_factory.mktemp("readme-server") / "stderr.log"
    command = [sys.executable, "-m", "deltaserve.server.cli", "serve", "--config", "/dev/null"]
    command += ["--model", str(cached_checkpoint("demo")), "--served-model-name", SERVED_NAME]
    # Greedy where an example sets no temperature: the same answers every run. Sampled, a
    # random-weight model's answer now and then ended in a newline (a blank printed line)
    command += ["--default-temperature", "0"]
    command += ["--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [(proc, log)])
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory holding the pictures the image examples read (a picture of yours)."""
    picture(96, 64).save(tmp_path / "cat.png")
    picture(96, 64, seed=1).save(tmp_path / "cat.jpg", quality=90)
    return tmp_path


def _text(body: dict[str, Any]) -> str:
    """The answer text of a non-streamed OpenAI or Anthropic response (else fail)."""
    if body.get("object") == "response":  # /v1/responses: its message items' text
        messages = [item for item in body["output"] if item["type"] == "message"]
        return "".join(part.get("text", "") for m in messages for part in m["content"])
    if "choices" in body:
        return "".join(
            c.get("message", {}).get("content") or c.get("text") or "" for c in body["choices"]
        )
    assert body.get("type") == "message", f"not an answer: {body}"
    return "".join(block.get("text", "") for block in body["content"])


def _delta(event: dict[str, Any]) -> str:
    """The text one streamed OpenAI chunk or Anthropic event adds."""
    if "choices" in event:
        return "".join(c["delta"].get("content") or "" for c in event["choices"])
    assert event.get("type") != "error", event
    delta = event.get("delta", {})
    return delta.get("text", "") if event.get("type") == "content_block_delta" else ""


def answer(raw: str) -> str:
    """The text of one curl call's output: a JSON response or an SSE stream."""
    if raw.lstrip().startswith("{"):
        return _text(json.loads(raw))
    data = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert data, f"neither JSON nor a stream: {raw[:500]!r}"
    return "".join(_delta(json.loads(d)) for d in data if d != "[DONE]")


# Records each curl call's output in its own file, then runs the example unchanged.
CURL_RECORDER = 'curl() { calls=$((calls + 1)); command curl "$@" >"$CURL_OUT/$calls"; }\ncalls=0\n'


@pytest.mark.parametrize(
    ("lang", "code"),
    [(lang, code) for lang, _, code in RUN],
    ids=[f"{lang}-line{line}" for lang, line, _ in RUN],
)
def test_readme_example_answers(server: str, workdir: Path, lang: str, code: str) -> None:
    """The example runs as written (the port aside) and every answer it gets is
    non-empty: each curl call's response or stream, each line a Python example prints."""
    code = code.replace(README_PORT, server)
    env = {**os.environ, "CURL_OUT": str(workdir / "curl"), "NO_PROXY": "127.0.0.1"}
    if lang == "bash":
        (workdir / "curl").mkdir()
        command = ["bash", "-euo", "pipefail", "-c", CURL_RECORDER + code]
    else:
        command = [sys.executable, "-c", code]
    result = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if lang == "bash":
        outputs = sorted((workdir / "curl").iterdir(), key=lambda p: int(p.name))
        assert outputs, "the example made no curl call"
        for output in outputs:
            raw = output.read_text()
            assert answer(raw).strip(), f"curl call {output.name} got no answer: {raw[:800]}"
    else:
        lines = result.stdout.splitlines()
        assert lines and all(line.strip() for line in lines), result.stdout
