"""deltaserve.kernels.cpu.host_memory: growing buffers reuse freed memory instead of faulting in
new pages.

Each case runs in a fresh interpreter (mallopt and MLX's cache limit are process-wide):
arrays of 2 MiB and more, 64 KiB larger every step, as a prompt's attention scores grow
with its context. The count is of minor page faults (getrusage), not time.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltaserve.kernels.cpu import host_memory

pytestmark = pytest.mark.skipif(host_memory._mallopt() is None, reason="needs glibc's mallopt")

_GROWING = """
import resource, sys
import mlx.core as mx
from deltaserve.kernels.cpu import host_memory
if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory()
else:
    mx.set_cache_limit(1 << 30)  # the engine's limit before kernels/cpu/host_memory.py
faults = []
for step in range(40):
    cols = 2048 + 64 * step  # [256, cols] float32: 2 MiB, +64 KiB a step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = mx.full((256, cols), 1.0)
    mx.eval(mx.exp(x * 0.5).sum(axis=-1))
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[20:]))
"""


def _faults(mode: str) -> int:
    """Minor page faults over the last 20 of 40 growing steps, in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", _GROWING, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


def test_growing_buffers_reuse_freed_memory() -> None:
    kept, cached = _faults("keep"), _faults("mlx-cache")
    # Three 2 MiB+ arrays a step are ~1,500 pages: MLX's size-exact cache faults them all
    # in again every step (measured ~2,000 a step); glibc's free lists serve them from the
    # last step's memory, faulting in only what they grew by (3 x 16 pages; measured ~32).
    assert cached > 20 * 1000, cached
    assert kept < 20 * 100, kept


def test_keep_freed_memory_turns_mlx_cache_off() -> None:
    code = (
        "import mlx.core as mx\nfrom deltaserve.kernels.cpu import host_memory\n"
        "assert host_memory.keep_freed_memory() and host_memory.keep_freed_memory()\n"
        "print(mx.set_cache_limit(0))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split()[-1] == "0"
