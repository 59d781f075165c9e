"""The install puts one name in site-packages, `deltaserve`, and a checkout imports the same
modules under the same names without an install (pyproject.toml, deltaserve/__init__.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("server", "engine", "models", "kernels")


def _build_wheel(tmp_path: Path) -> zipfile.ZipFile:
    # From a copy, so the build's build/ and *.egg-info never land in the checkout.
    src = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("deltaserve", *LAYERS):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path / "out"
    # A path, never a bare name: pip would take that for a project on the index.
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, src]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = out.glob("deltaserve-*.whl")
    return zipfile.ZipFile(wheel)


def test_wheel_installs_only_deltaserve(tmp_path: Path) -> None:
    """The wheel's top level is deltaserve/ and its dist-info; every file of the four layer
    folders (Python, gemv_shim.c, the status page) is inside as deltaserve/<layer>/...; the
    console script points into it."""
    with _build_wheel(tmp_path) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = wheel.read(entry_points).decode()
    assert {n.split("/")[0] for n in names} == {"deltaserve", "deltaserve-0.1.0.dist-info"}
    wanted = {"deltaserve/__init__.py"}
    for layer in LAYERS:
        for path in (REPO / layer).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                wanted.add(f"deltaserve/{path.relative_to(REPO).as_posix()}")
    assert wanted <= names, sorted(wanted - names)
    assert "deltaserve = deltaserve.server.cli:main" in scripts


# What a GPU machine without a package index runs: PYTHONPATH=<deps>:<repo>, no install.
_CHECKOUT = """
import sys
import deltaserve.engine.engine, deltaserve.kernels.gated_delta, deltaserve.server.app
assert deltaserve.kernels.gated_delta.__file__ == sys.argv[1] + "/kernels/gated_delta.py"
for name in ("engine", "server", "models", "kernels", "deltaserve.bench", "deltaserve.tests"):
    try:
        __import__(name)
    except ImportError:
        continue
    sys.exit(f"{name} imported")
"""


def test_checkout_imports_without_install(tmp_path: Path) -> None:
    """With `python -S` (no site: the editable install's finder never loads) and
    PYTHONPATH=<repo>:<site-packages>, deltaserve.* imports from the checkout's folders and
    `python -m deltaserve.models.testing` runs; the folders' bare names (`import engine`)
    and other folders (deltaserve.bench) do not import: one name per module."""
    site = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": f"{REPO}:{site}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    checkout = [sys.executable, "-S", "-c", _CHECKOUT, str(REPO)]
    result = subprocess.run(checkout, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    testing = [sys.executable, "-S", "-m", "deltaserve.models.testing", "--help"]
    result = subprocess.run(testing, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "python -m deltaserve.models.testing" in result.stdout
