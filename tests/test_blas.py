"""kernels/cpu/blas.py: OpenBLAS preloading by re-exec, and the GEMM self-check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import native_libs
import pytest

from deltaserve.kernels.cpu import blas

REPO_ROOT = Path(__file__).resolve().parents[1]
# Skips only where OpenBLAS does not apply; with CI=true a missing OpenBLAS fails.
needs_openblas = pytest.mark.usefixtures("openblas_required")


def _fresh_env() -> dict[str, str]:
    """This environment as a process started by hand would see it: no preload, no guard."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ENV_GUARD)}
    env.pop(blas.ENV_OPT_OUT, None)
    env["PYTHONPATH"] = str(REPO_ROOT)  # importable even without `pip install -e .`
    return env


def test_gemm_selfcheck_positive() -> None:
    """The self-check measures a positive, finite throughput and the summary reports it."""
    gflops = blas.gemm_selfcheck(128)
    assert 0 < gflops < 1e6
    assert blas.blas_summary(128).startswith("BLAS: ")


def test_guard_var_makes_ensure_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the guard set (we are the re-exec'd process) nothing is exec'd: no loop."""
    monkeypatch.setenv(blas.ENV_GUARD, "1")
    monkeypatch.delenv("LD_PRELOAD", raising=False)

    def fail_exec(*args: object) -> None:
        raise AssertionError("ensure_openblas re-exec'd despite the guard")

    monkeypatch.setattr(os, "execve", fail_exec)
    blas.ensure_openblas()
    assert blas.plan_openblas() == blas.BlasPlan()


def test_missing_lib_warns_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OpenBLAS on a CPU build: no re-exec, and a warning that says how to install it."""
    for var in (blas.ENV_GUARD, blas.ENV_OPT_OUT, "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(blas, "openblas_path", lambda: None)
    monkeypatch.setattr(blas, "_uses_gpu_backend", lambda: False)
    plan = blas.plan_openblas()
    assert plan.argv is None
    assert plan.warning is not None and blas.INSTALL_HINT in plan.warning


def test_missing_openblas_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CI=true a missing OpenBLAS fails the tests that need it; off CI they skip."""
    monkeypatch.setattr(blas, "openblas_path", lambda: None)
    monkeypatch.setattr(blas, "_uses_gpu_backend", lambda: False)
    monkeypatch.setattr(native_libs.sys, "platform", "linux")
    monkeypatch.setattr(native_libs, "ON_CI", True)
    with pytest.raises(AssertionError, match="CI=true and no OpenBLAS"):
        native_libs.require_openblas()
    monkeypatch.setattr(native_libs, "ON_CI", False)
    assert "OpenBLAS not installed" in (native_libs.openblas_does_not_apply() or "")


@needs_openblas
def test_this_pytest_runs_with_openblas() -> None:
    """conftest re-exec'd pytest, so OpenBLAS is really mapped into this process."""
    if os.environ.get(blas.ENV_OPT_OUT) == "1":
        pytest.skip(f"{blas.ENV_OPT_OUT}=1")
    assert blas.openblas_loaded() is not None, "OpenBLAS is installed but not preloaded"
    assert "OpenBLAS preloaded" in blas.blas_summary(128)


@needs_openblas
def test_python_c_reexecs_with_preload() -> None:
    """`python -c` calling ensure_openblas() comes back with the lib in LD_PRELOAD."""
    code = (
        "from deltaserve.kernels.cpu.blas import ensure_openblas; ensure_openblas(); "
        "import os; print(os.environ.get('LD_PRELOAD', ''))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_fresh_env(), capture_output=True, text=True, check=True
    ).stdout
    assert str(blas.openblas_path()) in out.split()


@needs_openblas
def test_python_m_replays_as_module(tmp_path: Path) -> None:
    """`python -m mod args` re-execs as `-m` (cwd first on sys.path), with its args intact."""
    (tmp_path / "probe_blas.py").write_text(
        "import json, os, sys\n"
        "from deltaserve.kernels.cpu.blas import ensure_openblas\n"
        "ensure_openblas()\n"
        "print(json.dumps([sys.argv[1:], sys.path[0], os.environ.get('LD_PRELOAD', '')]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "probe_blas", "--flag", "a b"],
        cwd=tmp_path,
        env=_fresh_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    args, path0, preload = json.loads(out)
    assert args == ["--flag", "a b"]
    assert Path(path0 or ".").resolve() == tmp_path.resolve()
    assert str(blas.openblas_path()) in preload.split()
