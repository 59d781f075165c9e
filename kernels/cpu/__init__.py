"""The Linux CPU platform: what makes MLX's CPU backend fast on Linux, apart from the kernels.

Two steps, each called from one place at start (kernels/platform.py says which):
`reexec_with_openblas()` before anything imports mlx (it may restart the process with
OpenBLAS and kernels/cpu/gemv_shim.c preloaded: kernels/cpu/blas.py), and
`keep_freed_memory()` once the model is loaded (glibc keeps freed buffers for the next
step: kernels/cpu/host_memory.py). `blas_in_use()` describes the BLAS for the platform
profile. On macOS (Accelerate, no glibc) none of it runs.

Imports nothing from server/, engine/ or models/, and mlx only inside the functions that
run after the re-exec.
"""

from __future__ import annotations

import sys


def is_linux() -> bool:
    """Whether this machinery applies: it preloads ELF libraries and tunes glibc's malloc."""
    return sys.platform.startswith("linux")


def reexec_with_openblas(argv: list[str] | None = None) -> None:
    """Before mlx is imported: on Linux, restart this process with OpenBLAS preloaded when
    MLX would run on the CPU (kernels/cpu/blas.py `ensure_openblas`); else nothing."""
    if not is_linux():
        return
    from deltaserve.kernels.cpu.blas import ensure_openblas

    ensure_openblas(argv)


def keep_freed_memory() -> bool:
    """After loading, on Linux: freed CPU buffers stay for the next step
    (kernels/cpu/host_memory.py). Returns whether glibc keeps them; False elsewhere."""
    if not is_linux():
        return False
    from deltaserve.kernels.cpu.host_memory import keep_freed_memory as keep

    return keep()


def blas_in_use() -> str:
    """The BLAS behind MLX's CPU matmuls in this process, in a few words."""
    if not is_linux():
        return "Accelerate" if sys.platform == "darwin" else "MLX's bundled BLAS"
    from deltaserve.kernels.cpu.blas import openblas_loaded
    from deltaserve.kernels.cpu.gemv_shim import shim_loaded

    lib = openblas_loaded()
    if lib is None:
        return "MLX's bundled reference BLAS"
    return f"OpenBLAS ({lib}; 1-row products as sgemv: {'on' if shim_loaded() else 'off'})"
