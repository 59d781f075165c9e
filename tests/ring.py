"""Environment for test processes that form an mx.distributed ring group on loopback:
what `mlx.launch --backend ring -n N` sets (a hostfile and each process's rank), without
the launcher process, which busy-polls the ranks' output (half a core on this 2-core
machine) and kills the others when one dies (the fault tests need to see that happen
on their own)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


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
