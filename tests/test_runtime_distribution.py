"""kvruntime is a distribution of its own (runtime/pyproject.toml): what its modules import is what it declares,
so `pip install ./runtime` runs without the compile stage (`make check-runtime` installs it alone and answers a
prompt); kvcompile depends on it at its version."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "runtime"
COMPILE_STAGE = {"kvcompile", "d3rlpy", "datasets", "scipy", "matplotlib"}


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower() for requirement in requirements}


def third_party_imports(folder: Path) -> dict[str, set[str]]:
    """Top-level modules imported by the files under `folder` (relative imports and the standard library left out)
    -> the files that import them."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "kvruntime":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def runtime_project() -> dict:
    return tomllib.loads((RUNTIME / "pyproject.toml").read_text())["project"]


def test_the_runtime_imports_only_what_it_declares():
    declared = requirement_names(runtime_project()["dependencies"])
    assert not declared & COMPILE_STAGE
    imported = third_party_imports(RUNTIME / "kvruntime")
    integrations = str(Path("runtime", "kvruntime", "integrations"))
    undeclared = {
        module: files
        for module, files in imported.items()
        if module not in declared and not all(f.startswith(integrations) for f in files)
    }
    assert not undeclared, f"imported by the runtime, not in runtime/pyproject.toml: {undeclared}"
    assert "torch" in imported and "transformers" in imported  # the scan sees imports at all


def test_the_optional_integrations_are_extras():
    extras = {name: requirement_names(r) for name, r in runtime_project()["optional-dependencies"].items()}
    integrations = third_party_imports(RUNTIME / "kvruntime" / "integrations")
    declared = requirement_names(runtime_project()["dependencies"])
    for module in set(integrations) - declared:
        assert module in extras and module in extras[module], f"{module}: give it an extra of its name"


def test_kvcompile_depends_on_this_runtime_and_does_not_ship_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = [r for r in project["project"]["dependencies"] if r.startswith("kvruntime")]
    assert pinned == [f"kvruntime=={runtime_project()['version']}"]
    assert "kvruntime" not in project["tool"]["setuptools"].get("package-dir", {})
