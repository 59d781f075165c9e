"""Shared pytest set-up for deltaserve's tests."""

# --- OpenBLAS bootstrap (kernels/blas.py). Keep this block first in the file: the plan
# must be made before anything below imports mlx. Tests then run with the same BLAS as
# the server (DESIGN.md §5).
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
