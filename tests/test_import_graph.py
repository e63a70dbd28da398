"""The package's import graph has no cycle, counting imports inside functions (issue #40's bar), and
the kernel layer has one dispatch: no op module but ``ops/dispatch.py`` reads the environment."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sglang_kvx"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module ``name`` imports, at any depth of its code (module- or function-level)."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_finder_sees_a_function_level_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def late():\n    from pkg import b\n")
    (tmp_path / "b.py").write_text("import pkg.a\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["pkg.c"] == {"pkg.a"}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_only_the_dispatch_reads_the_environment_in_the_kernel_layer() -> None:
    readers = sorted(path.name for path in (PACKAGE / "ops").glob("*.py")
                     if "environ" in path.read_text() and path.name != "dispatch.py")
    assert readers == []


def test_lower_floors_do_not_import_higher_ones() -> None:
    """The pipeline's floors: the kernel layer and the signals (what a prefill records) import no
    policy, runtime or SGLang seam; decode steps no runtime or seam."""
    modules = _modules()
    higher = {"sglang_kvx.ops": ("policies", "serve", "adapter", "signals", "decode"),
              "sglang_kvx.signals": ("policies", "serve", "adapter", "decode"),
              "sglang_kvx.decode": ("serve", "adapter")}
    wrong = []
    for name, path in modules.items():
        for floor, above in higher.items():
            if name == floor or name.startswith(floor + "."):
                wrong += [(name, m) for m in _imports(name, path, modules)
                          if any(m == f"sglang_kvx.{a}" or m.startswith(f"sglang_kvx.{a}.") for a in above)]
    assert wrong == []


def test_no_class_in_the_package_is_over_250_lines() -> None:
    """Issue #40's bar: no god object (a class that grows past it is missing an extension point)."""
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                too_long.append(f"{path.relative_to(PACKAGE.parent)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert too_long == []
