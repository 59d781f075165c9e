"""The import graph of server/, engine/, models/ and kernels/: a DAG whose edges point down.

Every import counts, wherever it is written: at module level, inside a function (a lazy
import), or under `if TYPE_CHECKING:`. A circle of lazy or type-only imports still means
two modules that cannot be read, tested or moved apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("server", "engine", "models", "kernels")  # each may import only those after it


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["deltaserve", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def _imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every dotted name an import statement anywhere in `tree` may load."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # maybe a submodule
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the four layers it imports (itself excluded)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for imported in _imported_names(ast.parse(path.read_text(), str(path)), package):
            parts = imported.split(".")
            found = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
            target = next((m for m in found if m in modules), None)
            if target is not None and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None for a DAG."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)) is not None:
            return cycle
    return None


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_graph_sees_every_kind_of_import() -> None:
    """The parser finds module-level, lazy and TYPE_CHECKING imports, and submodules named
    in a from-import."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from deltaserve.models import chat_format as fmt\n"
        "if TYPE_CHECKING:\n    from deltaserve.engine.plan import StepPlan\n"
        "def f():\n    import deltaserve.kernels.argmax\n"
    )
    names = _imported_names(tree, "deltaserve.engine")
    expected = {
        "deltaserve.models.chat_format",
        "deltaserve.engine.plan",
        "deltaserve.kernels.argmax",
    }
    assert expected <= names
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles() -> None:
    """No module reaches itself through imports of any kind."""
    graph = import_graph()
    assert len(graph) > 100 and any(graph.values())  # the walk found the packages
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_layers_import_downward_only() -> None:
    """server -> engine -> models -> kernels: no module imports a layer above its own."""
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if _layer(target) < _layer(module)
    )
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)
