"""Every third-party module the product imports is a declared runtime dependency, and
other distributions' modules install beside ours.

The server once imported jinja2 without declaring it: the test extra pulled it in, so CI
stayed green while `scripts/setup` (runtime dependencies only) crashed on a fresh clone.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("server", "engine", "models", "kernels")  # folders, installed as deltaserve.<layer>
# Imported only inside functions that tests call, never on a serving path.
TEST_ONLY = {"mlx_lm": "models/testing/checkpoint.py converts test checkpoints with it"}


def _imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_runtime() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = set()
    for spec in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
        names.add(_normalize(name))
    return names


def test_every_runtime_import_is_declared() -> None:
    """Modules imported under server/ engine/ models/ kernels/ that are neither ours nor
    the standard library map to a distribution listed in [project].dependencies."""
    modules = set()
    for layer in LAYERS:
        for path in (REPO / layer).rglob("*.py"):
            modules |= _imported_top_modules(path)
    third_party = modules - set(sys.stdlib_module_names) - {"deltaserve", "__future__"}
    dists = packages_distributions()
    declared = _declared_runtime()
    undeclared = {}
    for module in sorted(third_party - set(TEST_ONLY)):
        providers = {_normalize(d) for d in dists.get(module, [module])}
        if not providers & declared:
            undeclared[module] = sorted(providers)
    assert not undeclared, f"imported but not in [project].dependencies: {undeclared}"


def test_every_runtime_dependency_has_a_lower_bound() -> None:
    """Each runtime requirement says the oldest version it was written against."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    unbounded = [spec for spec in project["dependencies"] if ">=" not in spec]
    assert not unbounded, unbounded


def test_no_distribution_shadows_deltaserve() -> None:
    """No installed distribution other than ours provides a top-level `deltaserve`."""
    owners = set(packages_distributions().get("deltaserve", ())) - {"deltaserve"}
    assert not owners, f"distributions that install a top-level deltaserve: {owners}"


# Run from a temporary directory, as a user's program runs: no checkout on sys.path.
_BOTH_KERNELS = """
import json, kernels, deltaserve.kernels, deltaserve.kernels.gated_delta
print(json.dumps([kernels.__file__, hasattr(kernels, "get_kernel"), deltaserve.kernels.__file__]))
"""


def test_hugging_face_kernels_installs_beside_ours(tmp_path: Path) -> None:
    """Hugging Face's `kernels` distribution (transformers >= 5.25 requires it; the test
    extra installs it) and deltaserve.kernels import side by side in one process, as two
    different modules (ours once installed as top-level `kernels` and clashed with it)."""
    owners = packages_distributions()
    assert owners.get("kernels") == ["kernels"], owners.get("kernels")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", _BOTH_KERNELS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    theirs, is_hugging_faces, ours = json.loads(result.stdout)
    assert is_hugging_faces, theirs
    assert Path(ours).resolve() != Path(theirs).resolve()
