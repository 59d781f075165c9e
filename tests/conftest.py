"""Shared pytest set-up for deltaserve's tests."""

# --- OpenBLAS bootstrap (kernels/blas.py). Keep this block first in the file: the plan
# must be made before anything below imports mlx. Tests then run with the same BLAS as
# the server (DESIGN.md §5).
import sys
from pathlib import Path

import pytest

from deltaserve.kernels.blas import blas_summary, plan_openblas

_BLAS_PLAN = plan_openblas()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Act here, not at import: while conftests are imported pytest's fd capture points
    # stdout/stderr at temp files, and a re-exec'd pytest would inherit them and run silent.
    _BLAS_PLAN.apply()


def pytest_report_header(config: pytest.Config) -> str:
    return blas_summary()


# --- end of OpenBLAS bootstrap ---

# The repository root is on sys.path (python -m pytest puts the cwd first) for `tests.*`
# and `bench.*`. First, its kernels/ folder (deltaserve.kernels, which refuses any other
# name) would hide Hugging Face's `kernels`, which transformers >= 5.25 imports when it
# builds a model (tests/test_parity_transformers.py): keep the root, after site-packages.
_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO] + [str(_REPO)]
