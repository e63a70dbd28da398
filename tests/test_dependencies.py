"""Dependencies by role: serving needs SGLang and numpy (and what they pull); matplotlib (the
evaluation runner's plot), gguf and accelerate (the SmolLM2 GGUF conversion) come only through
extras, and the package imports them only inside the functions that need them.

"Not installed" is simulated in a fresh interpreter by ``sys.modules[name] = None``: ``import name``
then raises ImportError and ``importlib.util.find_spec(name)`` returns None, which is how
transformers probes for optional packages (a meta-path finder that raises would break that probe,
not simulate absence).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTRAS_ONLY = ("matplotlib", "gguf", "accelerate")
SERVING_MODULES = ("sglang_kvx", "sglang_kvx.config", "sglang_kvx.adapter.plugin", "sglang_kvx.serve.runtime")

IMPORT_WITHOUT = """
import importlib, importlib.util, json, pkgutil, sys
blocked, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in blocked:
    sys.modules[name] = None
for name in blocked:  # the simulation holds: the package is gone for import and for probing
    assert importlib.util.find_spec(name) is None, name
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise AssertionError(name + " still imports")
if modules == ["ALL"]:
    import sglang_kvx
    modules = [m.name for m in pkgutil.walk_packages(sglang_kvx.__path__, "sglang_kvx.")
               if "cupy" not in m.name and not m.name.endswith("__main__")]
for name in modules:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in blocked and sys.modules[m] is not None)
print(json.dumps({"imported": len(modules), "loaded": loaded}))
"""


def import_without(blocked: tuple[str, ...], modules: list[str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT, json.dumps(list(blocked)), json.dumps(modules)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_serving_modules_import_without_the_extras():
    report = import_without(EXTRAS_ONLY, list(SERVING_MODULES))
    assert report == {"imported": len(SERVING_MODULES), "loaded": []}


def test_every_module_imports_without_matplotlib_and_accelerate():
    # gguf stays: SGLang's own layers import it at module level (sglang requires gguf), so the
    # modules that load SGLang's internals need it whatever this package does.
    report = import_without(("matplotlib", "accelerate"), ["ALL"])
    assert report["imported"] > 50 and report["loaded"] == []


def eager_imports(source: str, names: tuple[str, ...]) -> list[int]:
    """Lines of the imports of ``names`` that run when the module is imported (anywhere but
    inside a function body)."""
    lines = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and not in_function:
                modules = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                if any(m.split(".")[0] in names for m in modules):
                    lines.append(child.lineno)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return lines


def test_the_extras_are_imported_only_inside_functions():
    eager = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "sglang_kvx").rglob("*.py"))
             for line in eager_imports(path.read_text(), EXTRAS_ONLY)]
    assert eager == []
    # the check sees what it must: module-level imports, under try/if too; not one in a function
    probe = ("import gguf\ntry:\n    from matplotlib import pyplot\nexcept ImportError:\n    pass\n"
             "if True:\n    import accelerate.utils\ndef plot():\n    import matplotlib\n")
    assert eager_imports(probe, EXTRAS_ONLY) == [1, 3, 7]


def requirement_name(spec: str) -> str:
    for stop in "<>=!~;[ ":
        spec = spec.split(stop)[0]
    return spec.strip().lower()


def test_extras_by_role_and_setup_installs_what_the_tests_need():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = {name: {requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    assert {"sglang", "numpy"} <= core
    assert core.isdisjoint(EXTRAS_ONLY)
    assert "matplotlib" in extras["eval"]
    assert {"gguf", "accelerate"} <= extras["gguf"]
    assert extras["eval"] | extras["gguf"] | {"pytest", "pytest-xdist"} <= extras["test"]  # test.sh runs two workers
    assert any(name.startswith("cupy-cuda") for name in extras["gpu"])  # its CUDA major: tests/test_gpu_defaults.py
    # the README's commands run scripts/setup.sh, which installs the test extra
    assert '-e ".[test]"' in (ROOT / "scripts" / "setup.sh").read_text()
    for script in ("demo.sh", "test.sh"):
        assert "bash scripts/setup.sh" in (ROOT / "scripts" / script).read_text()


def test_eval_runner_names_the_extra_when_matplotlib_is_missing(monkeypatch, capsys):
    from sglang_kvx.eval import runner

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:  # before any server or request
        runner.main(["--url", "http://127.0.0.1:9"])
    assert exit_info.value.code == 2
    assert "pip install 'sglang-kvx[eval]'" in capsys.readouterr().err


def test_convert_smollm2_names_the_extra_when_accelerate_is_missing(monkeypatch, capsys):
    from sglang_kvx import cli
    from sglang_kvx.models import smollm2

    monkeypatch.setattr(smollm2, "is_converted", lambda path: False)
    monkeypatch.setattr(smollm2, "convert_smollm2", lambda **kw: pytest.fail("converted without accelerate"))
    monkeypatch.setitem(sys.modules, "accelerate", None)
    assert cli.main(["convert-smollm2"]) == 1
    assert capsys.readouterr().err.strip() == "convert-smollm2 needs accelerate: pip install 'sglang-kvx[gguf]'"
