"""Names for the kernels we build with `mx.fast.cuda_kernel` / `mx.fast.metal_kernel`.

MLX keys a compiled custom kernel by its name and template arguments only, not by its
source: in the process, and on CUDA on disk as well (NVRTC's output under
/tmp/mlx/<version>/ptx, or MLX_PTX_CACHE_DIR, kept across runs). A kernel whose source
changed but whose name did not would load the old build from that cache and run it
without a word. Every kernel's name therefore carries a digest of its text.
"""

from __future__ import annotations

import hashlib

__all__ = ["kernel_name"]


def kernel_name(base: str, source: str, header: str = "") -> str:
    """`base` followed by a 10-hex-digit digest of the kernel's header and source."""
    digest = hashlib.sha256(f"{header}\0{source}".encode()).hexdigest()[:10]
    return f"{base}_{digest}"
