"""Server processes for tests: a free port, waiting until /health answers, and the
environment of processes that form an mx.distributed ring group on loopback (what
`mlx.launch --backend ring -n N` sets: a hostfile and each process's rank), without the
launcher process, which busy-polls the ranks' output (half a core on this 2-core
machine) and kills the others when one dies (the fault tests need to see that happen
on their own)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


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
