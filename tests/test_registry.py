"""One registration per method (issue #32): every method folder registers itself (`spec.py`) and builds itself
(`method.py`), its declared options are its dataclass's fields, and every list of methods (the command line's help,
`eval`'s and `tune`'s defaults, the README's table) comes from the registry. Adding a method touches its own folder
only: a small example method is added, used by name everywhere, and removed."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvruntime
from kvcompile.evaluation.contestants import default_methods
from kvruntime import KVRuntimeError
from kvruntime.registry import (
    COMPARED_NAMES,
    ERROR_AWARE_NAMES,
    METHOD_NAMES,
    METHODS,
    canonical_name,
    method_spec,
    methods_table,
)

ROOT = Path(__file__).resolve().parents[1]
METHODS_FOLDER = ROOT / "runtime" / "kvruntime" / "methods"


def test_every_method_folder_registers_itself_and_every_registration_has_its_method():
    folders = {entry.name for entry in METHODS_FOLDER.iterdir() if (entry / "method.py").is_file()}
    registered = {entry.name for entry in METHODS_FOLDER.iterdir() if (entry / "spec.py").is_file()}
    assert folders == registered == set(METHODS)
    for name in METHODS:
        assert callable(importlib.import_module(f"kvruntime.methods.{name}.method").build), name


@pytest.mark.parametrize("name", sorted(METHODS))
def test_declared_options_are_the_methods_own_fields_with_their_defaults(name):
    spec = METHODS[name]
    built = importlib.import_module(f"kvruntime.methods.{name}.method").build
    method_type = inspect.signature(built).return_annotation
    method_type = getattr(importlib.import_module(f"kvruntime.methods.{name}.method"), method_type)
    fields = {field.name: field for field in dataclasses.fields(method_type)}
    for option, declared in spec.options.items():
        assert option in fields, (name, option)
        assert fields[option].default == declared.default, (name, option)
    assert fields["window"].default == spec.window


# Where a method's name may appear as a string outside its own folders (runtime/kvruntime/methods/<name>/ and
# kvcompile/recipes/<name or alias>/): the registry (the default method), and the peer library's namespace (kvpress's presses
# named after the methods whose artifacts build them).
NAMES_ALLOWED_IN = {"runtime/kvruntime/registry.py", "runtime/kvruntime/integrations/kvpress.py"}
NAMES_ALLOWED_IN |= {"kvcompile/evaluation/contestants.py"}


def method_names_in(path: Path) -> set[str]:
    """The registered method names (bare or `+error-aware`) that are a whole string constant of a module's code."""
    names = set(METHODS) | {f"{name}+error-aware" for name in METHODS} | set(METHOD_NAMES)
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    }


def test_no_code_outside_a_methods_folders_branches_on_its_name():
    """Adding or changing a method touches its folders only: no other module names it (`spec.name == "..."`)."""
    found = []
    for path in [*(ROOT / "runtime" / "kvruntime").rglob("*.py"), *(ROOT / "kvcompile").rglob("*.py")]:
        relative = path.relative_to(ROOT).as_posix()
        if relative in NAMES_ALLOWED_IN or "/build/" in relative:
            continue
        for name in method_names_in(path):
            base = method_spec(name)[0]  # an alias or a +error-aware name: the method it is
            folders = (base.name, *base.aliases)  # srh's recipes are CompressKV's (compresskv: srh+error-aware)
            homes = tuple(
                f"{root}/{f}/" for f in folders for root in ("runtime/kvruntime/methods", "kvcompile/recipes")
            )
            if not relative.startswith(homes):
                found.append(f"{relative}: {name!r}")
    assert found == []


def test_the_readmes_method_table_is_the_registrys():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- methods:start -->\n", "\n<!-- methods:end -->"
    assert start in readme and end in readme, "README.md holds the methods table between its markers"
    table = readme[readme.index(start) + len(start) : readme.index(end)].strip()
    assert table == methods_table(), f"README.md's methods table is not the registry's; write:\n{methods_table()}"


def test_the_command_line_and_eval_name_the_registered_methods():
    for command in (["--help"], ["generate", "--help"]):
        help_text = run_cli(*command)
        assert all(name in help_text for name in METHOD_NAMES), command
    assert default_methods().split(",")[1 : 1 + len(COMPARED_NAMES)] == list(COMPARED_NAMES)
    assert set(COMPARED_NAMES) <= set(METHOD_NAMES)


@pytest.mark.parametrize("name", ERROR_AWARE_NAMES)
def test_the_error_aware_suffix_is_read_as_written_before_its_rename(name):
    """`+error-aware` was `+budgets` until issue #65 (a budget is tokens per layer): eval records and tuned defaults
    name it so, and it still names the same method, reported under its new name."""
    assert method_spec(f"{name}+budgets") == method_spec(f"{name}+error-aware") == (METHODS[name], True)
    reported = canonical_name(f"{name}+budgets")
    assert reported == canonical_name(f"{name}+error-aware")
    assert reported == {"srh": "compresskv"}.get(name, f"{name}+error-aware")
    with pytest.raises(KVRuntimeError, match=f"unknown method '{name}\\+budget'.*<method>\\+error-aware"):
        method_spec(f"{name}+budget")


def run_cli(*args: str, runtime: Path | None = None) -> str:
    """`kvcompile ARGS` in a fresh interpreter (a fresh registry; the kvruntime package in the folder `runtime`
    when given), its output unwrapped."""
    code = "import sys; from kvcompile.cli import main; sys.argv = ['kvcompile', *sys.argv[1:]]; main()"
    paths = {"PYTHONPATH": str(runtime)} if runtime is not None else {}
    result = subprocess.run(
        [sys.executable, "-P", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400", **paths},
    )
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())


EXAMPLE_SPEC = '''
"""An example method: keeps the most recent tokens."""

from ...registry import MethodSpec, Option

SPEC = MethodSpec(
    name="recent_tail",
    summary="keeps the most recent tokens",
    window=4,
    options={"reverse": Option(bool, False, "keep the oldest tokens instead")},
    error_aware=True,
)
'''
EXAMPLE_METHOD = '''
"""The example method."""

import dataclasses
from typing import Any

import torch

from ...registry import option_fields
from ..base import ScoringMethod
from .spec import SPEC


@dataclasses.dataclass
class RecentTail(option_fields(SPEC), ScoringMethod):  # its options (window, reverse): declared once, in spec.py
    name = "recent_tail"

    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        batch, kv_heads, _, _, length = attention.shape
        order = torch.arange(length, dtype=attention.dtype)
        return (-order if self.reverse else order).expand(batch, kv_heads, length).clone()


def build(compiled: Any, options: dict[str, object]) -> RecentTail:
    return RecentTail(**options)
'''
EXAMPLE_USE = """
import torch
from conftest import tiny_model

import kvruntime
from kvruntime.registry import METHOD_NAMES
from kvruntime.requests.serving import method_facts

model = tiny_model("llama")
ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
for name, options in (("recent_tail", {}), ("recent_tail", {"reverse": True})):
    with kvruntime.compress(model, name, ratio=0.5, options=options) as session:
        session.prefill(ids)
    print(name, options, session.kept_positions[0][0, 0].tolist())
print("recent_tail" in METHOD_NAMES, method_facts("recent_tail+error-aware").streams)
"""


def test_a_method_added_in_its_own_folder_is_known_everywhere(tmp_path):
    """A method folder added to a copy of the runtime (never to the source tree: a killed run would leave it there)
    is known to the runtime and the command line that import that copy, and to nothing else."""
    shutil.copytree(
        ROOT / "runtime" / "kvruntime", tmp_path / "kvruntime", ignore=shutil.ignore_patterns("__pycache__")
    )
    folder = tmp_path / "kvruntime" / "methods" / "recent_tail"
    folder.mkdir()
    (folder / "__init__.py").write_text('"""An example method."""\n')
    (folder / "spec.py").write_text(textwrap.dedent(EXAMPLE_SPEC).lstrip())
    (folder / "method.py").write_text(textwrap.dedent(EXAMPLE_METHOD).lstrip())
    script = tmp_path / "use.py"  # run from tmp_path: its kvruntime is the copy
    script.write_text(EXAMPLE_USE)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"recent_tail {{}} {list(range(20, 40))}"  # the newest half
    assert lines[1] == f"recent_tail {{'reverse': True}} {[*range(16), *range(36, 40)]}"  # the oldest, window kept
    assert lines[2] == "True True"
    assert "recent_tail" in run_cli("--help", runtime=tmp_path)
    assert "recent_tail" in run_cli("generate", "--help", runtime=tmp_path)
    assert "recent_tail" in run_cli("eval", "--help", runtime=tmp_path)  # eval's default methods
    assert "recent_tail" not in run_cli("generate", "--help")
    assert "recent_tail" not in kvruntime.METHOD_NAMES
    assert not (METHODS_FOLDER / "recent_tail").exists()


def test_every_registered_method_has_its_page_linked_from_the_docs_index():
    """Adding a method adds its docs page; the docs index's list of pages is checked against the registry, not kept
    by hand alone (an alias's page may point to its method's, as compresskv's does)."""
    index = (ROOT / "docs" / "README.md").read_text()
    assert {name for name in METHODS if not (ROOT / "docs" / "methods" / f"{name}.md").is_file()} == set()
    assert {name for name in METHODS if f"(methods/{name}.md)" not in index} == set()
