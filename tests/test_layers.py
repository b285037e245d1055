"""The package's shape: layers without cycles, private names kept private, benchmarks apart.

Read from the source (AST): every import counts, at module level, inside a function or under
``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mixedopt

PACKAGE = Path(mixedopt.__file__).parent


def module_name(path: Path) -> str:
    parts = ("mixedopt", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> list[tuple[str, str | None]]:
    """(module imported from, name) for each name a module imports from a mixedopt module; the
    name is None where a module itself is imported."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, None) if is_module(submodule) else (source, alias.name))
    return [(source, name) for source, name in found if source.split(".")[0] == "mixedopt"]


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {
    name: {source for source, _ in imports_of(path)} - {name} for name, path in MODULES.items()
}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_modules():
    # A package importing its own submodules (``__init__``) is where the layers start.
    graph = {name: targets - {"mixedopt"} for name, targets in GRAPH.items()}
    assert cycles(graph) == []


def test_no_module_imports_another_modules_private_names():
    private = [
        f"{name} imports {imported} from {source}"
        for name, path in MODULES.items()
        for source, imported in imports_of(path)
        if imported is not None and imported.startswith("_")
    ]
    assert private == []


def test_the_library_never_imports_the_benchmarks():
    library = {name for name in MODULES if not name.startswith("mixedopt.bench")}
    assert not [
        (name, GRAPH[name])
        for name in library
        if any(target.startswith("mixedopt.bench") for target in GRAPH[name])
    ]
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, mixedopt; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "mixedopt.bench" not in loaded
    assert "mixedopt._storage" in loaded  # what it does load is listed


def library_classes() -> list[type]:
    """The classes defined in the library's modules (the benchmarks left out)."""
    import importlib
    import inspect

    found = []
    for name in MODULES:
        if name.startswith("mixedopt.bench") or name == "mixedopt.__main__":
            continue
        module = importlib.import_module(name)
        found += [
            cls for _, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__ == name
        ]
    return found


def test_the_library_is_components_not_mixins():
    # Only the optimizer files derive from a library class: each from MixedPrecisionOptimizer
    # (AdamW from mixedopt's Adam, as torch's AdamW from torch's Adam) and its torch.optim
    # parent. Everything else is composed (an optimizer owns its step's
    # stages, a storage its bucket store and scales), not mixed in.
    derived = {
        f"{cls.__module__}.{cls.__qualname__}": sorted(
            base.__qualname__ for base in cls.__bases__ if base.__module__.startswith("mixedopt")
        )
        for cls in library_classes()
    }
    derived = {name: bases for name, bases in derived.items() if bases}
    optimizers = ["ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "Adamax", "Muon", "NAdam"]
    optimizers += ["RAdam", "RMSprop", "Rprop", "SGD"]
    expected = {
        f"mixedopt.{name.lower()}.{name}": ["MixedPrecisionOptimizer"] for name in optimizers
    }
    assert derived == {**expected, "mixedopt.adamw.AdamW": ["Adam"]}
