"""Make OpenBLAS the BLAS behind MLX's CPU backend, and measure what we got.

The mlx-cpu wheel links a bundled *reference* BLAS (~3 GFLOP/s f32 GEMM). Debian's
OpenBLAS exports the same `sgemm_`/`cblas_sgemm` symbols, so when it is in LD_PRELOAD
the dynamic loader binds MLX's GEMMs to it (30-60 GFLOP/s on 2 cores). LD_PRELOAD is
only read when a process starts, hence `ensure_openblas()` re-executes the current
process with it set; it must run before anything imports `mlx.core`.

This module imports nothing from server/, engine/ or models/, and imports mlx lazily so
that `ensure_openblas()` costs nothing when it does not re-exec.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import deltaserve.kernels.cpu.gemv_shim as gemv_shim

logger = logging.getLogger(__name__)

ENV_LIB = "DELTASERVE_OPENBLAS"  # path to a libopenblas.so to use instead of the search
ENV_OPT_OUT = "DELTASERVE_NO_OPENBLAS"  # "1": leave the BLAS alone
ENV_GUARD = "DELTASERVE_BLAS_REEXEC"  # set in the re-executed process: never re-exec twice

INSTALL_HINT = "apt-get install -y libopenblas0-pthread"

# Debian's OpenBLAS flavours, best first. pthread is what we measured; openmp/serial are
# the other builds of the same library; the bare `openblas` dir is older layouts'.
_DEBIAN_FLAVOURS = ("openblas-pthread", "openblas-openmp", "openblas-serial", "openblas")

_warned: set[str] = set()  # warnings already logged by this process


def _multiarch() -> str:
    return sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"


def _candidate_paths() -> list[Path]:
    lib_dir = Path("/usr/lib") / _multiarch()
    paths = [lib_dir / flavour / "libopenblas.so.0" for flavour in _DEBIAN_FLAVOURS]
    # The alternatives symlink Debian keeps for whichever flavour is selected.
    paths.append(lib_dir / "libopenblas.so.0")
    return paths


def openblas_path() -> Path | None:
    """Return the OpenBLAS shared library to preload, or None when there is none.

    `$DELTASERVE_OPENBLAS` wins when it names an existing file; otherwise Debian's
    locations are searched (pthread build first).
    """
    override = os.environ.get(ENV_LIB)
    if override:
        path = Path(override)
        if path.is_file():
            return path
        logger.warning("%s=%s does not exist; searching the usual places", ENV_LIB, path)
    return next((path for path in _candidate_paths() if path.is_file()), None)


def _preload_entries(value: str | None = None) -> list[str]:
    # ld.so accepts both colons and spaces as LD_PRELOAD separators.
    value = os.environ.get("LD_PRELOAD", "") if value is None else value
    return value.replace(":", " ").split()


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_preloaded(lib: Path) -> bool:
    # Any OpenBLAS the user preloaded counts: stacking a second flavour on it gains nothing.
    return any("openblas" in Path(e).name or _same_file(e, lib) for e in _preload_entries())


def _uses_gpu_backend() -> bool:
    """Whether MLX will run on a GPU, decided without importing mlx (that would be too late)."""
    if "mlx.core" in sys.modules:  # asked directly: the platform profile builds on this module
        import mlx.core as mx

        return mx.default_device() != mx.cpu
    # On Linux the backend is chosen at install time: mlx[cuda*] pulls an mlx-cuda-* wheel.
    for dist in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def _default_argv() -> list[str] | None:
    """The command line that restarts this process exactly, or None if there is none.

    `sys.orig_argv` keeps the interpreter's own view (`-m pkg`, `-c code`, `-X` flags, the
    console-script path), unlike `sys.argv`, whose `-m` form is a file path: re-running
    that as a script would put the package dir instead of the cwd on sys.path.
    """
    if not sys.executable or sys.argv[:1] in ([], [""], ["-"]):
        return None  # embedded, interactive, or a program read from stdin: can't replay it
    # argv[0] must be the real path: CPython finds its venv (pyvenv.cfg) from argv[0], and a
    # bare "python" would be looked up on PATH again and could land outside the venv.
    return [sys.executable, *sys.orig_argv[1:]]


@dataclass(frozen=True)
class BlasPlan:
    """What `ensure_openblas()` decided: re-exec with `argv`/`env`, warn, or nothing.

    Deciding and acting are split for pytest: a conftest must decide at import (before
    anything imports mlx) but act later, once pytest has stopped capturing stdout/stderr.
    """

    argv: list[str] | None = None  # full command line, argv[0] the interpreter path
    env: dict[str, str] | None = None  # the environment for the new process image
    warning: str | None = None  # why the slow BLAS stays, for the user to fix

    def apply(self) -> None:
        """Log the warning (once per process) and/or replace this process image."""
        if self.warning is not None and self.warning not in _warned:
            _warned.add(self.warning)
            # Logging is usually not configured this early; its last-resort handler still
            # prints WARNING to stderr, which is what we want: visible, but once.
            logger.warning(self.warning)
        if self.argv is not None and self.env is not None:
            # execve skips atexit and buffered-stream flushing: push out what was written.
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
            os.execve(self.argv[0], self.argv, self.env)


def plan_openblas(argv: list[str] | None = None) -> BlasPlan:
    """Decide what `ensure_openblas(argv)` would do, without doing it (see there)."""
    if not sys.platform.startswith("linux"):
        return BlasPlan()  # macOS uses Accelerate; nothing to fix
    if os.environ.get(ENV_OPT_OUT) == "1" or os.environ.get(ENV_GUARD) == "1":
        return BlasPlan()
    lib = openblas_path()
    if lib is None:
        if _uses_gpu_backend():
            return BlasPlan()
        return BlasPlan(
            warning="OpenBLAS not found: MLX's CPU matmuls use its bundled reference BLAS "
            f"(~10x slower). Install it with `{INSTALL_HINT}` "
            f"(or set {ENV_LIB}=/path/to/libopenblas.so)."
        )
    if _uses_gpu_backend():
        return BlasPlan()
    shim, why = gemv_shim.shim_path()
    note = None
    if shim is None and why != f"{gemv_shim.ENV_OPT_OUT}=1":
        note = (
            f"{why}: MLX's matrix-vector products (batch-1 decode) keep OpenBLAS's sgemm "
            "path, 3-5x slower than sgemv"
        )
    shim_done = shim is None or any(_same_file(e, shim) for e in _preload_entries())
    if _is_preloaded(lib) and shim_done:
        return BlasPlan(warning=note)
    if "mlx.core" in sys.modules:
        # Re-exec would technically work, but the caller has run past its start-up (mlx is
        # live, threads or sockets may be too): restarting it from here would surprise.
        return BlasPlan(
            warning="ensure_openblas() ran after mlx.core was imported, so MLX keeps its "
            f"slow reference BLAS. Call it first, or start with LD_PRELOAD={lib}"
        )
    new_argv = argv if argv is not None else _default_argv()
    if new_argv is None:
        return BlasPlan(warning=f"Cannot re-exec this process; start it with LD_PRELOAD={lib}")
    env = dict(os.environ)
    # The shim goes first: its cblas_sgemm must win the symbol and then finds OpenBLAS's.
    first = [] if shim_done else [str(shim)]
    first += [] if _is_preloaded(lib) else [str(lib)]
    env["LD_PRELOAD"] = " ".join([*first, *_preload_entries()])
    env[ENV_GUARD] = "1"
    return BlasPlan(argv=new_argv, env=env, warning=note)  # the new process plans nothing


def ensure_openblas(argv: list[str] | None = None) -> None:
    """Restart this process with OpenBLAS preloaded when MLX would run on the CPU.

    Call it first thing in an entry point, before `mlx.core` is imported. It returns
    normally (doing nothing) when: not on Linux; `$DELTASERVE_NO_OPENBLAS=1`; this is
    already the re-executed process (`$DELTASERVE_BLAS_REEXEC=1`); an OpenBLAS is already
    in LD_PRELOAD; MLX has a GPU backend. It warns once and returns when no OpenBLAS is
    installed (the warning gives the install command) or mlx.core is already imported.
    Otherwise it never returns: the process image is replaced.

    Args:
        argv: the full command line to exec, argv[0] being the interpreter path. Defaults
            to this process's own: `python -m pkg`, `python -c`, console scripts and
            pytest all replay as they were started.
    """
    plan_openblas(argv).apply()


def openblas_loaded() -> Path | None:
    """The OpenBLAS from LD_PRELOAD if it is really mapped into this process, else None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    mapped = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if " /" in line}
    for entry in _preload_entries():
        if "openblas" in entry and any(_same_file(entry, path) for path in mapped):
            return Path(entry)
    return None


def gemm_selfcheck(n: int = 512, min_seconds: float = 0.1) -> float:
    """Measure float32 n x n GEMM throughput on MLX's default device, in GFLOP/s.

    One warm-up product (first-call dispatch, BLAS thread start), then products until at
    least `min_seconds` and 3 repeats have passed, each forced with `mx.eval`.
    """
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(a, b, a @ b)
    repeats = 0
    start = time.perf_counter()
    while repeats < 3 or time.perf_counter() - start < min_seconds:
        mx.eval(a @ b)
        repeats += 1
    elapsed = time.perf_counter() - start
    return 2.0 * n**3 * repeats / elapsed / 1e9


def blas_summary(n: int = 512) -> str:
    """One log line: which BLAS MLX uses and the measured f32 GEMM GFLOP/s."""
    gflops = gemm_selfcheck(n)
    if _uses_gpu_backend():
        source = "mlx GPU backend (BLAS not used)"
    elif (lib := openblas_loaded()) is not None:
        gemv = "on" if gemv_shim.shim_loaded() else "off"
        source = f"OpenBLAS preloaded ({lib}; 1-row products as sgemv: {gemv})"
    else:
        source = f"mlx bundled reference BLAS (slow; {INSTALL_HINT})"
    return f"BLAS: {source}, f32 GEMM {gflops:.1f} GFLOP/s"
