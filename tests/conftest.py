"""Shared pytest set-up for deltaserve's tests."""

# --- OpenBLAS bootstrap (kernels/cpu/blas.py). Keep this block first in the file: the plan
# must be made before anything below imports mlx. Tests then run with the same BLAS as
# the server (DESIGN.md §5).
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltaserve.kernels.cpu.blas import blas_summary, plan_openblas

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

from native_libs import require_gemv_shim, require_openblas  # noqa: E402

from deltaserve.kernels.platform import use_platform  # noqa: E402


@pytest.fixture
def openblas_required() -> None:
    """Skips where OpenBLAS does not apply, else fails without it (tests/native_libs.py)."""
    require_openblas()


@pytest.fixture
def gemv_shim_required() -> None:
    """The same for kernels/cpu/gemv_shim.c, whose compile error fails (tests/native_libs.py)."""
    require_openblas()
    require_gemv_shim()


@pytest.fixture(autouse=True)
def _device_platform() -> Iterator[None]:
    """Each test starts and ends on the device's default profile: an engine a test builds
    makes its config's profile current (kernels/platform.py), which must not leak."""
    use_platform(None)
    yield
    use_platform(None)


@pytest.fixture(autouse=True)
def _no_start_up_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built without warm_up_seconds do not trace at start on a GPU (its 60 s
    default is the server's start-up, tested with an explicit value in
    tests/test_compiled_prompt.py): on the GPU test machine every engine a test builds
    would otherwise spend it."""
    from deltaserve.engine import engine

    monkeypatch.setattr(engine, "WARM_UP_GPU_SECONDS", 0.0)


_CHUNK_COSTS: dict[tuple[int, bool], tuple[object, object]] = {}


@pytest.fixture(autouse=True)
def _chunk_cost_once_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU every engine measures what a prompt chunk costs when it starts
    (engine/scheduling/chunk_cost.py: a dozen forwards and two compiled traces); the GPU
    test machine's tests build dozens of engines over a few models, so each model is
    measured once per process and the engines after the first reuse its figure. The
    CPU measures nothing."""
    from deltaserve.engine import engine
    from deltaserve.engine.compiled_prefill import CompiledPrefill
    from deltaserve.engine.scheduling.step_cost import ChunkCost
    from deltaserve.models.build import LoadedModel

    measure = engine.measure_chunk_cost

    def once(
        loaded: LoadedModel, compiled: CompiledPrefill | None = None, packed: object = None
    ) -> ChunkCost:
        key = (id(loaded), compiled is not None, packed is not None)
        if key not in _CHUNK_COSTS:  # the model is kept, so its id is not reused
            _CHUNK_COSTS[key] = (loaded, measure(loaded, compiled, packed))
        return _CHUNK_COSTS[key][1]

    monkeypatch.setattr(engine, "measure_chunk_cost", once)
