"""The docs name what exists (issue #77): every Python file they quote in backticks, by path or by name, is one of
the project's (a quoted file once named `budgets.py`, which no longer existed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "runtime" / "README.md"]
# Names the docs quote as examples of a hostile bundle's files, not as the project's.
NOT_THE_PROJECTS = {"typer.py", "torch.py"}
QUOTED = re.compile(r"`([A-Za-z0-9_./-]+\.py)(?::[0-9-]+)?`")


def test_every_python_file_the_docs_quote_exists():
    files = [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        if not {".venv", ".venv-bench"} & set(path.relative_to(ROOT).parts)
    ]
    names = {file.rsplit("/", 1)[-1] for file in files}
    missing = []
    for doc in DOCS:
        for quoted in QUOTED.findall(doc.read_text()):
            found = (
                any(file == quoted or file.endswith("/" + quoted) for file in files)
                if "/" in quoted
                else quoted in names
            )
            if not found and quoted not in NOT_THE_PROJECTS:
                missing.append(f"{doc.relative_to(ROOT)}: {quoted}")
    assert missing == []


# A dotted name under the project's packages, quoted in backticks: a module, or a name defined in one.
DOTTED = re.compile(r"`((?:kvruntime|kvcompile)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\([^`]*\))?`")


def _defines(module: str, names: list[str]) -> bool:
    """Whether `module` exists and defines `names` (an attribute path). A module whose optional dependency is not
    installed (kvpress's integration) is read as text: its top-level definitions."""
    import importlib

    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name.split(".")[0] in ("kvruntime", "kvcompile"):
            return False
        source = ROOT / ("runtime" if module.startswith("kvruntime") else "") / (module.replace(".", "/") + ".py")
        defined = {
            node.name
            for node in ast.parse(source.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        }
        return not names or names[0] in defined
    for name in names:
        found = getattr(found, name, None)
    return found is not None


def test_every_module_and_name_the_docs_quote_by_its_dotted_path_exists():
    """`kvruntime.plumbing.recording.recorded_prefill`: the longest prefix that is a module, then names in it."""
    missing = []
    for doc in DOCS:
        for quoted in set(DOTTED.findall(doc.read_text())):
            parts = quoted.split(".")
            split = next((n for n in range(len(parts), 0, -1) if _module_file(".".join(parts[:n])) is not None), 0)
            if not split or not _defines(".".join(parts[:split]), parts[split:]):
                missing.append(f"{doc.relative_to(ROOT)}: {quoted}")
    assert missing == []


def _module_file(module: str) -> Path | None:
    base = ROOT / ("runtime" if module.startswith("kvruntime") else "") / module.replace(".", "/")
    return next((path for path in (base.with_suffix(".py"), base / "__init__.py") if path.exists()), None)


OPTIONS_ROW = re.compile(r"^\| options \| (.*) \|$", re.M)
REQUEST_OPTIONS = {"memory", "prefill_chunk_size", "merge", "window"}  # every method's, described in design.md


def _stated_defaults(row: str) -> dict[str, str]:
    """What an options row says each option defaults to: "`name=V` (default)", or "default V" inside the
    parenthesis after "`name`"."""
    stated = {name: value for name, value in re.findall(r"`(\w+)=([^`]+)` \(default\)", row)}
    for name, said in re.findall(r"`(\w+)` \(((?:[^()]|\([^()]*\))*)\)", row):
        value = re.search(r"\bdefault (?!since)`?([-\w.]+)`?", said)
        if value:
            stated[name] = value.group(1)
    return stated


def _same(value: str, default: object) -> bool:
    if isinstance(default, bool) or default is None:
        return value == str(default).lower()
    if isinstance(default, (int, float)):
        return float(value) == float(default)
    return value == str(default)


def test_every_methods_options_row_names_its_options_and_their_defaults_as_the_registry_declares():
    from kvruntime.registry import METHODS

    problems = []
    for name, spec in METHODS.items():
        page = ROOT / "docs" / "methods" / f"{name}.md"
        rows = OPTIONS_ROW.findall(page.read_text()) if page.exists() else []
        if len(rows) != 1:
            problems.append(f"{name}: {len(rows)} options rows in docs/methods/{name}.md")
            continue
        row = rows[0]
        named = set(re.findall(r"`(\w+)(?:=[^`]*)?`", row))
        if not spec.options:
            if not row.startswith("none of its own"):
                problems.append(f"{name}: declares no option of its own, the docs name some")
            continue
        problems += [f"{name}: option {option} not in its docs" for option in sorted(set(spec.options) - named)]
        for option, value in _stated_defaults(row).items():
            declared = spec.all_options.get(option)
            if declared is None and option not in REQUEST_OPTIONS:
                problems.append(f"{name}: the docs give a default to {option}, which is no option of it")
            elif declared is not None and not _same(value, declared.default):
                problems.append(f"{name}: the docs say {option} defaults to {value}, the registry {declared.default}")
    assert problems == []


def test_the_options_check_reads_defaults_as_the_docs_write_them():
    row = (
        "`mode=compiled` (default) or `mode=dynamic`; `floor` (a share; default 0.25, the teacher's), `x` (default: t)"
    )
    assert _stated_defaults(row) == {"mode": "compiled", "floor": "0.25"}
