"""Server processes for tests: a free port, `deltaserve serve` on the tiny checkpoint,
waiting until /health answers, and the environment of processes that form an
mx.distributed ring group on loopback (what `mlx.launch --backend ring -n N` sets: a
hostfile and each process's rank), without the launcher process, which busy-polls the
ranks' output (half a core on this 2-core machine) and kills the others when one dies
(the fault tests need to see that happen on their own)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from deltaserve.models.testing import cached_checkpoint

REPO = Path(__file__).resolve().parents[1]
# `deltaserve serve` as a subprocess, without the checkout's config.yaml
SERVE = (sys.executable, "-m", "deltaserve.server.cli", "serve", "--config", "/dev/null")


def free_port() -> int:
    """A TCP port nothing listens on now (bind to 0, read it back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ring_envs(tmp_path: Path, size: int = 2) -> list[dict[str, str]]:
    """One environment per rank (os.environ plus the ring's hostfile and rank)."""
    hostfile = tmp_path / "ring-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(size)]))
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_HOSTFILE": str(hostfile)}
    return [base | {"MLX_RANK": str(r), "MLX_WORLD_SIZE": str(size)} for r in range(size)]


def wait_healthy(url: str, procs: Sequence[tuple[subprocess.Popen, Path]]) -> None:
    """Until GET url/health is 200; fails when a process (with its log) exits first or
    after 180 s."""
    deadline = time.monotonic() + 180
    while True:
        for proc, log in procs:
            assert proc.poll() is None, f"a server process exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the server did not become ready"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@contextmanager
def serve_tiny(log: Path, *args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`deltaserve serve` on the tiny checkpoint and a free port, with `args` added and its
    stderr in `log`: yields (process, url) once /health answers; stops it after
    (SIGTERM, SIGKILL after 15 s) if it still runs."""
    port = free_port()
    command = list(SERVE)
    command += ["--model", str(cached_checkpoint("tiny")), "--port", str(port), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [(proc, log)])
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
