"""Matrix-vector products through sgemv on the CPU: build and find kernels/cpu/gemv_shim.c.

MLX's CPU backend calls cblas_sgemm for every float32 matmul. OpenBLAS 0.3.21 (Debian 12)
runs a product with one row (or one column) through its packing GEMM driver, 3-5x slower
than its own sgemv, and at batch 1 a decode step is only such products: the small shape's
248,320 x 256 LM head took 14.3 ms as sgemm and 6.1 ms as sgemv; 1024 x 1024 180 vs 33 us.
The shim is a cblas_sgemm that sends those products to cblas_sgemv and the rest
to OpenBLAS. kernels/cpu/blas.py preloads it ahead of OpenBLAS; it is compiled here once per
source version with the system C compiler into the user's cache directory.

No C compiler means no shim: blas.py then warns once and MLX's products keep OpenBLAS's
sgemm path (correct, slower at batch 1). `$DELTASERVE_NO_GEMV_SHIM=1` leaves it out;
`$DELTASERVE_GEMV_SHIM=PATH` names a shim built beforehand (the Docker image does).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("gemv_shim.c")
ENV_OPT_OUT = "DELTASERVE_NO_GEMV_SHIM"  # "1": do not preload the shim
ENV_PATH = "DELTASERVE_GEMV_SHIM"  # a shim built beforehand (docker/Dockerfile): no compiler
MARKER = "deltaserve_gemv_shim_version"  # a symbol only the shim exports


def cache_dir() -> Path:
    """Where built shims live: $XDG_CACHE_HOME/deltaserve, else ~/.cache/deltaserve."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deltaserve"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def shim_path() -> tuple[Path | None, str | None]:
    """(the built shim, None), or (None, why there is none). Builds it on first use.

    The file name carries a hash of the source, so an edited shim is rebuilt; the build
    goes to a temporary name that is renamed into place (concurrent builders are safe).
    """
    if os.environ.get(ENV_OPT_OUT) == "1":
        return None, f"{ENV_OPT_OUT}=1"
    prebuilt = os.environ.get(ENV_PATH)
    if prebuilt:
        if Path(prebuilt).is_file():
            return Path(prebuilt), None
        return None, f"{ENV_PATH}={prebuilt} does not exist"
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    target = cache_dir() / f"gemv_shim-{digest}.so"
    if target.is_file():
        return target, None
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc, gcc or clang) to build kernels/cpu/gemv_shim.c"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-ldl"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            os.unlink(tmp)
            why = done.stderr.strip()[:200]
            return None, f"{compiler} failed on kernels/cpu/gemv_shim.c: {why}"
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"could not build kernels/cpu/gemv_shim.c: {error}"
    return target, None


def shim_loaded() -> bool:
    """Whether this process resolves cblas_sgemm to the shim (it was preloaded)."""
    return hasattr(ctypes.CDLL(None), MARKER)
