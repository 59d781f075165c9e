"""deltaserve: an OpenAI-compatible continuous-batching inference server for Qwen3.5 on MLX.

The four layers live in the repository's top folders and import as deltaserve.server,
deltaserve.engine, deltaserve.models and deltaserve.kernels (DESIGN.md §1). An install
copies them under this package (pyproject.toml maps them). In a checkout used without
an install (PYTHONPATH=<repo>, or `python -m deltaserve...` from the repo root) they
are not beside this file: the finder below serves exactly those four names from the
repo's folders, so `deltaserve.bench` or `deltaserve.tests` never import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

LAYERS = ("server", "engine", "models", "kernels")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds deltaserve.<layer> in the checkout's <layer>/ folder; deeper modules then
    resolve through that package's __path__ as usual."""

    def __init__(self, root: Path) -> None:
        self.folders = {f"{__name__}.{layer}": root / layer for layer in LAYERS}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _checkout_root() -> Path | None:
    """The repository root when this file is the checkout's (layers beside this folder,
    not inside it), else None (an installed copy)."""
    here = Path(__file__).resolve().parent
    if (here / "engine").is_dir():
        return None
    root = here.parent
    if all((root / layer / "__init__.py").is_file() for layer in LAYERS):
        return root
    return None


_root = _checkout_root()
if _root is not None and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutFinder(_root))
