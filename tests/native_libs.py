"""OpenBLAS and the gemv shim in tests: skip only where they do not apply (STYLE.md: a
skip must not hide a failure). Where one should be in this process and is not (OpenBLAS
missing with CI=true; kernels/cpu/gemv_shim.c not compiling or not preloaded), the test that
needs it fails. conftest wraps `require_*` as the fixtures `openblas_required` and
`gemv_shim_required`."""

from __future__ import annotations

import os
import sys

import pytest

from deltaserve.kernels.cpu import blas, gemv_shim

ON_CI = os.environ.get("CI") == "true"  # .ci/run installs OpenBLAS or fails


def openblas_does_not_apply() -> str | None:
    """Why this process legitimately runs without OpenBLAS, or None: it must have it."""
    if not sys.platform.startswith("linux"):
        return "not Linux: MLX uses Accelerate, not OpenBLAS"
    if blas._uses_gpu_backend():
        return "MLX runs on a GPU: its CPU BLAS is not used"
    if blas.openblas_path() is None and not ON_CI:
        return f"OpenBLAS not installed ({blas.INSTALL_HINT}); with CI=true this fails"
    return None


def shim_does_not_apply() -> str | None:
    """Why kernels/cpu/gemv_shim.c legitimately is not preloaded here, or None: it must be
    (a Linux CPU process with OpenBLAS and a C compiler). A compile error is no reason."""
    if (why := openblas_does_not_apply()) is not None:
        return why
    for opt_out in (blas.ENV_OPT_OUT, gemv_shim.ENV_OPT_OUT):
        if os.environ.get(opt_out) == "1":
            return f"{opt_out}=1"
    if not os.environ.get(gemv_shim.ENV_PATH) and gemv_shim._compiler() is None:
        return "no C compiler (cc, gcc or clang) to build kernels/cpu/gemv_shim.c"
    return None


def require_openblas() -> None:
    """Skip where OpenBLAS does not apply; elsewhere fail unless it is installed."""
    if (why := openblas_does_not_apply()) is not None:
        pytest.skip(why)
    assert blas.openblas_path() is not None, f"CI=true and no OpenBLAS: {blas.INSTALL_HINT}"


def require_gemv_shim() -> None:
    """Skip where the shim does not apply; elsewhere fail unless it built and is loaded."""
    if (why := shim_does_not_apply()) is not None:
        pytest.skip(why)
    path, why = gemv_shim.shim_path()
    assert path is not None, f"the gemv shim should build here and did not: {why}"
    assert gemv_shim.shim_loaded(), f"{path} built but is not preloaded"
