"""Guards against the suite's regrowth: servers come from the shared pool, markers stay true.

The runtime guard (``conftest._servers_start_only_in_the_pool``) fails any test that starts a
server process without the ``fresh_process`` marker; this reads the test files, so that a new
file breaking the rule fails in ``scripts/test.sh --quick`` already, before anything runs.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Only the pool (and conftest's guard around it) constructs servers; these strings in a command
# line start a server process.
POOL_MODULES = ("server_pool.py", "conftest.py")
STARTING_STRINGS = ("sglang.launch_server", "sglang_kvx.engine")


def marked(node: ast.AST, marker: str) -> bool:
    return any(marker in ast.unparse(decorator) for decorator in getattr(node, "decorator_list", []))


def starting_functions(tree: ast.Module) -> tuple[set[str], dict[str, ast.FunctionDef]]:
    """Names of the module's functions that start a server, directly or through the module's own
    helpers and constants; and every top-level function by name."""
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    constants = {target.id for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)
                 and any(s in ast.unparse(node.value) for s in STARTING_STRINGS)}

    def direct(function: ast.AST) -> bool:
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ServerProcess":
                return True
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(s in node.value for s in STARTING_STRINGS):
                return True
            if isinstance(node, ast.Name) and node.id in constants:
                return True
        return False

    starting = {name for name, node in functions.items() if direct(node)}
    while True:
        more = {name for name, node in functions.items() if name not in starting and any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in starting for n in ast.walk(node))}
        if not more:
            return starting, functions
        starting |= more


def test_no_test_file_starts_a_server_outside_the_pool() -> None:
    offenders = []
    for path in sorted(TESTS.glob("*.py")):
        if path.name in (*POOL_MODULES, Path(__file__).name):
            continue
        tree = ast.parse(path.read_text())
        module_fresh = any(isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0])
                           and "fresh_process" in ast.unparse(node.value) for node in tree.body)
        starting, functions = starting_functions(tree)
        for name in sorted(starting):
            node = functions[name]
            is_test_or_fixture = name.startswith("test_") or marked(node, "fixture")
            if is_test_or_fixture and not (module_fresh or marked(node, "fresh_process")):
                offenders.append(f"{path.name}::{name}")
    assert not offenders, ("these start a server outside tests/server_pool.py; use server_pool.get(...), or mark "
                           f"them fresh_process if they need a process of their own: {offenders}")


def test_the_guard_sees_a_server_started_through_a_helper() -> None:
    """The check above can fail: a test reaching ServerProcess through a helper is found, one marked is not."""
    tree = ast.parse(
        "def helper():\n    return ServerProcess('m')\n"
        "def test_a():\n    helper()\n"
        "@pytest.mark.fresh_process\ndef test_b():\n    helper()\n"
        "SCRIPT = 'import sglang_kvx.engine'\n"
        "def test_c():\n    run(SCRIPT)\n"
        "def test_d():\n    pass\n")
    starting, functions = starting_functions(tree)
    assert starting == {"helper", "test_a", "test_b", "test_c"}
    assert marked(functions["test_b"], "fresh_process") and not marked(functions["test_a"], "fresh_process")


def test_the_markers_the_suite_enforces_are_declared() -> None:
    declared = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    names = {line.split(":")[0] for line in declared}
    assert {"slow", "fresh_process", "quick", "long", "gpu"} <= names, names


def test_the_file_order_names_files_that_exist() -> None:
    """A renamed file (or test) would silently fall out of its pytest-xdist group (tests/file_order.py):
    every file named exists, and every pattern of a server group names a file that exists and a test in it."""
    import ast

    from file_order import FILE_ORDER, SERVER_GROUPS

    missing = [name for name in FILE_ORDER if not (TESTS / name).is_file()]
    for group, patterns in SERVER_GROUPS:
        for pattern in patterns:
            file_name, _, test = pattern.partition("::")
            path = TESTS / file_name
            if not path.is_file():
                missing.append(f"{group}: {file_name}")
                continue
            names = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
            prefix = test.split("[", 1)[0].rstrip("*")
            if not any(name.startswith(prefix) for name in names if name.startswith("test_")):
                missing.append(f"{group}: {pattern}")
    assert not missing, f"tests/file_order.py names files or tests that do not exist: {missing}"
