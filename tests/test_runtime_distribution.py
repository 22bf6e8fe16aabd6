"""kvruntime is a distribution of its own (runtime/pyproject.toml): what its modules import, and what transformers
needs to load the default model's GGUF, is what it declares, so `pip install ./runtime` runs without the compile
stage (`make check-runtime` installs it alone, with an empty model cache, and answers a prompt); kvcompile depends
on it at its version."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

from kvruntime.errors import KVRuntimeError
from kvruntime.models import default_model

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


def test_every_dependency_is_imported_or_needed_by_transformers_to_load_the_default_model():
    declared = requirement_names(runtime_project()["dependencies"])
    imported = set(third_party_imports(RUNTIME / "kvruntime"))
    loader_needs = set(default_model.GGUF_LOADER_NEEDS)
    assert loader_needs <= declared, "transformers cannot load the default model's GGUF without these"
    assert not loader_needs & imported, "imported by the runtime: no need to list it in GGUF_LOADER_NEEDS"
    assert declared <= imported | loader_needs, f"declared but never needed: {declared - imported - loader_needs}"


def test_loading_the_default_model_without_accelerate_refuses_in_one_line(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never read: the refusal comes first
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "gguf_of", lambda name: gguf)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # importlib finds no accelerate
    with pytest.raises(KVRuntimeError) as refused:
        default_model.load_shipped_model("default", lambda folder: pytest.fail("nothing to load"))
    message = str(refused.value)
    assert "\n" not in message and "accelerate" in message and "`pip install accelerate`" in message
    assert not any((tmp_path / "cache" / "models").iterdir())  # no half-built cache left behind


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
