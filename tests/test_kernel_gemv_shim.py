"""kernels/cpu/gemv_shim.c: 1-row and 1-column float32 matmuls through sgemv equal the GEMM's.

The shim is preloaded into this pytest process by conftest (kernels/cpu/blas.py), so every
MLX matmul below whose M or N is 1 goes through it; numpy in float64 is the reference.
Where the shim should build (a Linux CPU process with OpenBLAS and a C compiler) and does
not, these tests fail; they skip only where it does not apply (conftest's
`gemv_shim_required`).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from native_libs import require_gemv_shim

from deltaserve.kernels.cpu import blas, gemv_shim

needs_shim = pytest.mark.usefixtures("gemv_shim_required")
needs_openblas = pytest.mark.usefixtures("openblas_required")


def _check(out: mx.array, ref: np.ndarray) -> None:
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)


def _arrays(rng: np.random.Generator, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@needs_shim
def test_pytest_runs_with_the_shim_where_it_applies() -> None:
    """Where the shim applies it built and conftest preloaded it (the summary says so)."""
    assert "as sgemv: on" in blas.blas_summary(64)


def test_a_compile_error_fails_the_shim_tests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A shim that does not compile fails the tests that need it, with the compiler's
    message; it does not turn them into skips (they skip only where the shim does not
    apply, and then so does this)."""
    broken = tmp_path / "gemv_shim.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(gemv_shim, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemv_shim.ENV_PATH, raising=False)
    with pytest.raises(AssertionError, match="failed on kernels/cpu/gemv_shim.c"):
        require_gemv_shim()


@needs_shim
@pytest.mark.parametrize("n, k", [(1, 1), (7, 5), (300, 64), (4099, 256)])
@pytest.mark.parametrize("transposed", [False, True])
def test_one_row_times_matrix(n: int, k: int, transposed: bool) -> None:
    """[1, K] @ [K, N] with B stored either way (x @ W.T is a transposed B)."""
    rng = np.random.default_rng(n * k)
    x, w = _arrays(rng, (1, k), (n, k) if transposed else (k, n))
    b = mx.array(w).T if transposed else mx.array(w)
    _check(mx.array(x) @ b, x.astype(np.float64) @ (w.T if transposed else w))


@needs_shim
@pytest.mark.parametrize("m, k", [(3, 1), (257, 33), (1024, 128)])
@pytest.mark.parametrize("transposed", [False, True])
def test_matrix_times_one_column(m: int, k: int, transposed: bool) -> None:
    """[M, K] @ [K, 1] with A stored either way, and a [1, K]-stored column (b.T)."""
    rng = np.random.default_rng(m + k)
    a, col = _arrays(rng, (k, m) if transposed else (m, k), (1, k))
    lhs = mx.array(a).T if transposed else mx.array(a)
    ref_a = (a.T if transposed else a).astype(np.float64)
    _check(lhs @ mx.array(col).T, ref_a @ col.T)
    _check(lhs @ mx.array(np.ascontiguousarray(col.T)), ref_a @ col.T)
    (wide,) = _arrays(rng, (k, 9))  # a column of a wider matrix: ldb = 9
    _check(lhs @ mx.array(wide)[:, 4:5], ref_a @ wide[:, 4:5])


@needs_shim
def test_strided_operands_batches_and_addmm() -> None:
    """Row slices of wider arrays (lda > K), a transposed 1-row A, batched 1-row products,
    and addmm's alpha / beta, as MLX passes them to cblas_sgemm."""
    rng = np.random.default_rng(7)
    wide, w, c = _arrays(rng, (6, 96), (96, 130), (1, 130))
    x = mx.array(wide)[2:3, :]  # one row of a wider matrix
    _check(x @ mx.array(w), wide[2:3].astype(np.float64) @ w)
    col = mx.array(np.ascontiguousarray(wide[2:3].T))  # [96, 1] stored: A transposed
    _check(col.T @ mx.array(w), wide[2:3].astype(np.float64) @ w)
    xs, ws = _arrays(rng, (4, 1, 96), (4, 96, 50))
    _check(mx.array(xs) @ mx.array(ws), xs.astype(np.float64) @ ws)
    out = mx.addmm(mx.array(c), mx.array(wide[2:3]), mx.array(w), alpha=0.5, beta=2.0)
    _check(out, 2.0 * c + 0.5 * (wide[2:3].astype(np.float64) @ w))


@needs_shim
def test_general_products_still_take_the_gemm() -> None:
    """M, N > 1 goes to OpenBLAS's own sgemm unchanged."""
    rng = np.random.default_rng(3)
    a, b = _arrays(rng, (33, 64), (64, 70))
    _check(mx.array(a) @ mx.array(b), a.astype(np.float64) @ b)
    _check(mx.array(a).T.T @ mx.array(b).T.T, a.astype(np.float64) @ b)


def _stored(rng: np.random.Generator, rows: int, cols: int, pad: int) -> np.ndarray:
    """A [rows, cols] operand inside a [rows, cols + pad] buffer (leading dim cols + pad)."""
    return rng.standard_normal((rows, cols + pad)).astype(np.float32)


@needs_shim
@pytest.mark.parametrize("m, n", [(1, 37), (29, 1), (1, 1)])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_cblas_sgemm_every_layout(m: int, n: int, trans_a: bool, trans_b: bool) -> None:
    """cblas_sgemm called directly (it resolves to the shim) with padded leading
    dimensions, alpha and beta, against numpy: every branch of the shim's C code, also
    those MLX never reaches (it copies strided operands first)."""
    k, pad, alpha, beta = 19, 3, 0.75, -1.5
    rng = np.random.default_rng(m * 100 + n + 10 * trans_a + trans_b)
    a = _stored(rng, k, m, pad) if trans_a else _stored(rng, m, k, pad)
    b = _stored(rng, n, k, pad) if trans_b else _stored(rng, k, n, pad)
    c = _stored(rng, m, n, pad)
    op_a = (a[:, :m].T if trans_a else a[:, :k]).astype(np.float64)
    op_b = (b[:, :k].T if trans_b else b[:, :n]).astype(np.float64)
    expected = c.astype(np.float64).copy()
    expected[:, :n] = alpha * (op_a @ op_b) + beta * c[:, :n]
    ptr = ctypes.POINTER(ctypes.c_float)
    ctypes.CDLL(None).cblas_sgemm(
        101, 112 if trans_a else 111, 112 if trans_b else 111, m, n, k,
        ctypes.c_float(alpha), a.ctypes.data_as(ptr), a.shape[1], b.ctypes.data_as(ptr),
        b.shape[1], ctypes.c_float(beta), c.ctypes.data_as(ptr), c.shape[1],
    )  # fmt: skip
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-5)  # padding untouched too


def _plan_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A process started by hand: no preload, no guard, the shim cache in tmp_path."""
    for var in (blas.ENV_GUARD, blas.ENV_OPT_OUT, gemv_shim.ENV_OPT_OUT, gemv_shim.ENV_PATH):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(blas, "_uses_gpu_backend", lambda: False)
    monkeypatch.delitem(sys.modules, "mlx.core")  # plan as a process does before mlx loads


@needs_shim
def test_plan_preloads_the_shim_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The re-exec puts the built shim ahead of OpenBLAS (its cblas_sgemm must win)."""
    _plan_env(monkeypatch, tmp_path)
    plan = blas.plan_openblas(["python"])
    assert plan.env is not None and plan.warning is None
    first, second = plan.env["LD_PRELOAD"].split()[:2]
    assert first.startswith(str(tmp_path)) and "gemv_shim" in first
    assert second == str(blas.openblas_path())


@needs_openblas
def test_no_compiler_warns_and_keeps_openblas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a compiler the process still gets OpenBLAS, and a warning says why the
    1-row products stay slow (the re-exec'd process plans nothing, so it is said here)."""
    _plan_env(monkeypatch, tmp_path)
    monkeypatch.setattr(gemv_shim, "_compiler", lambda: None)
    plan = blas.plan_openblas(["python"])
    assert plan.env is not None
    assert plan.env["LD_PRELOAD"].split() == [str(blas.openblas_path())]
    assert plan.warning is not None and "no C compiler" in plan.warning
