"""`deltaserve serve` on two processes (tensor parallel, ring backend on loopback, started
with the environment `mlx.launch` would set): rank 0 answers over HTTP with the tokens one
process computes; a rank that dies or hangs ends the other with a clear error and exit
status 3 within a bounded time; ranks that disagree on the config refuse to start."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.parallel.tensor_parallel import EXIT_LOST
from deltaserve.engine.types import SamplingParams
from deltaserve.models.build import load_model
from deltaserve.models.testing import cached_checkpoint
from deltaserve.server.frontend.tokenizer import TextTokenizer
from tests.processes import SERVE, free_port, ring_envs, wait_healthy

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 10  # --distributed-timeout-s (start-up holds the GIL for seconds at a time)
PROMPTS = [[9707, 11, 1879, 0, 151, 3000], list(range(100, 140))]


class Ranks:
    """Two `deltaserve serve` processes forming one tensor-parallel group."""

    def __init__(self, tmp_path: Path, extra: list[list[str]] | None = None) -> None:
        self.port = free_port()
        self.logs = [tmp_path / f"rank{r}.log" for r in range(2)]
        self.procs = []
        for rank, env in enumerate(ring_envs(tmp_path)):
            command = [*SERVE, "--model", str(cached_checkpoint("tiny")), "--port", str(self.port)]
            command += ["--distributed-backend", "ring"]
            command += ["--distributed-timeout-s", str(TIMEOUT_S), *(extra or [[], []])[rank]]
            with self.logs[rank].open("w") as log:
                self.procs.append(
                    subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
                )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        wait_healthy(self.url, list(zip(self.procs, self.logs, strict=True)))

    def wait_exit(self, rank: int, within_s: float) -> int:
        try:
            return self.procs[rank].wait(within_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still runs:\n{self.logs[rank].read_text()[-3000:]}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    cached_checkpoint("tiny")
    group = Ranks(tmp_path)
    try:
        group.wait_ready()
        yield group
    finally:
        group.close()


def test_two_rank_server_answers_like_one_process(ranks: Ranks) -> None:
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    reply = httpx.post(f"{ranks.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    texts = [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]
    loaded = load_model(str(cached_checkpoint("tiny")))
    alone = LLMEngine(loaded).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    tokenizer = TextTokenizer(loaded.path, loaded.config.eos_token_ids)
    assert texts == [tokenizer.decode(c.token_ids) for c in alone]


@pytest.mark.parametrize(
    ("victim", "signum"),
    [(1, signal.SIGKILL), (1, signal.SIGSTOP), (0, signal.SIGKILL), (0, signal.SIGSTOP)],
)
def test_a_lost_rank_ends_the_other(ranks: Ranks, victim: int, signum: int) -> None:
    """Stopped: the other's watchdog runs out. Killed: the other sees its sockets close,
    or (when its blocked wait never hears of it) the watchdog runs out too."""
    os.kill(ranks.procs[victim].pid, signum)
    other = 1 - victim
    started = time.monotonic()
    assert ranks.wait_exit(other, within_s=TIMEOUT_S + 10) == EXIT_LOST
    assert time.monotonic() - started < TIMEOUT_S + 10
    log = ranks.logs[other].read_text()
    assert "deltaserve: error: tensor parallel:" in log
    timed_out = f"no answer from the other ranks within {TIMEOUT_S} s" in log
    assert timed_out or (signum == signal.SIGKILL and "lost a rank" in log)


def test_ranks_with_different_configs_refuse_to_start(tmp_path: Path) -> None:
    group = Ranks(tmp_path, extra=[[], ["--max-num-seqs", "8"]])
    try:
        for rank in (0, 1):
            assert group.wait_exit(rank, within_s=120) == 2
            assert (
                "do not load the same checkpoint and engine config" in group.logs[rank].read_text()
            )
    finally:
        group.close()
