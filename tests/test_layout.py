"""The structure the README's layout section promises: one home per artifact kind that the runtime, the recipes and
the command line agree on; the compile stage uses only kvruntime's declared API; methods get the request, refuse
what they cannot serve before any model work, and the engine knows no method by name."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

import kvruntime
from kvcompile import recipe
from kvcompile.cli import app
from kvcompile.evaluation.contestants import artifact_paths, parse_methods, resolve_contestants
from kvcompile.recipes import RECIPES
from kvruntime import ARTIFACT_KINDS, KVRuntimeError, Request, get_method, read_artifact
from kvruntime.methods.build import READERS
from kvruntime.registry import METHOD_NAMES, METHODS

ROOT = Path(__file__).parent.parent
SHIPPED = ROOT / "artifacts" / "smollm2-135m-instruct"
runner = CliRunner()


def cli_commands() -> set[str]:
    return set(get_command(app).commands)


def test_every_artifact_kind_is_compiled_by_a_command_that_exists_and_read_by_a_class_that_exists():
    for kind in ARTIFACT_KINDS.values():
        if kind.command:
            program, command = kind.command.split()
            assert program == "kvcompile" and command in cli_commands(), kind
    assert set(READERS) <= set(ARTIFACT_KINDS)
    assert all(callable(reader.from_artifact) for reader in READERS.values())


def test_every_recipe_writes_a_known_kind_whose_command_is_its_own_and_every_applied_kind_has_a_recipe():
    for kind, recipe_type in RECIPES.items():
        assert recipe_type.kind == kind and kind in ARTIFACT_KINDS
        assert ARTIFACT_KINDS[kind].command.split()[1] in cli_commands()
        # merge finishes what can be split
        assert recipe_type.shardable == (recipe_type.finish is not recipe.Recipe.finish), kind
    assert {spec.needs for spec in METHODS.values() if spec.needs} <= set(RECIPES)


def test_the_compile_stage_imports_kvruntimes_api_or_its_modules_never_a_private_name():
    """kvcompile takes kvruntime's public names from the package and anything else by its module path (what the
    compile stage measures exactly as the runtime applies it), never a private (`_`) name or module."""
    offending = []
    for path in (ROOT / "kvcompile").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvruntime":
                private = any(part.startswith("_") for part in node.module.split("."))
                offending += [
                    f"{path}: from {node.module} import {a.name}"
                    for a in node.names
                    if private
                    or a.name.startswith("_")
                    or (node.module == "kvruntime" and a.name not in kvruntime.__all__)
                ]
                if node.module != "kvruntime":
                    importlib.import_module(node.module)  # a module that exists
    assert offending == []


def test_kvruntimes_public_api_is_small_and_every_name_resolves():
    assert len(kvruntime.__all__) <= 26  # 24 before saved contexts (issue #76) added save_context and load_context
    for name in kvruntime.__all__:
        assert getattr(kvruntime, name) is not None, name


def test_the_engines_hooks_and_selection_name_no_method():
    modules = (ROOT / "runtime" / "kvruntime" / "engine").glob("*.py")  # but `compress`'s docs (__init__.py)
    source = "".join(path.read_text() for path in modules if path.name != "__init__.py")
    assert [name for name in METHOD_NAMES if name in source] == []


def test_the_engine_is_modules_of_one_concern_and_no_function_is_long():
    """The engine package's modules stay small (one concern each), and no function of the runtime or the compile
    stage runs past 80 lines."""
    engine = sorted((ROOT / "runtime" / "kvruntime" / "engine").glob("*.py"))
    assert len(engine) >= 6
    assert {path.name: n for path in engine if (n := len(path.read_text().splitlines())) > 350} == {}
    long = {}
    for folder in (ROOT / "runtime" / "kvruntime", ROOT / "kvcompile"):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}


def test_the_default_models_artifact_folder_is_named_once():
    """Benchmarks find the default model's artifacts through `kvcompile.recipe` (`artifact_folder`,
    `default_artifact`), never by spelling out its folder."""
    folder = recipe.artifact_folder("default").name
    spelled = [path for path in (ROOT / "benchmarks").rglob("*.py") if f"artifacts/{folder}" in path.read_text()]
    assert spelled == []


def test_compilerkv_serves_ratios_and_refuses_a_budget_not_compiled_before_the_model_loads(monkeypatch):
    monkeypatch.setattr(
        recipe, "load_model", lambda model, **_: pytest.fail("the model was loaded before the request was checked")
    )
    prompt = ROOT / "calibration_data" / "prompts" / "passkey_2k.txt"
    result = runner.invoke(app, ["generate", "--method", "compilerkv", "--budget", "300", "--prompt-file", str(prompt)])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "not 300" in result.output and "--nearest-budget" in result.output
    tables = [read_artifact(SHIPPED / "compilerkv_tables.safetensors")]
    get_method("compilerkv", tables).check_request(Request(ratio=0.5))  # a ratio: the nearest budget's tables
    get_method("compilerkv", tables).check_request(Request(budget=256))  # a compiled budget
    get_method("compilerkv", tables, {"nearest_budget": True}).check_request(Request(budget=300))  # allowed near
    with pytest.raises(KVRuntimeError, match="not 300"):
        get_method("compilerkv", tables).check_request(Request(budget=300))


def test_eval_method_options_are_typed_and_checked_before_the_model_loads():
    (contestant,) = parse_methods("compilerkv:fixed_threshold=0.9")[1:]
    assert contestant.options == {"fixed_threshold": 0.9}
    paths = artifact_paths([contestant], (SHIPPED,))
    resolve_contestants([contestant], paths, (0.5, 0.9))
    assert (
        get_method(
            contestant.method, [read_artifact(p) for p in paths[contestant.label]], contestant.options
        ).fixed_threshold
        == 0.9
    )
    (compiled,) = parse_methods("compilerkv:nearest_budget=false")[1:]
    resolve_contestants([compiled], artifact_paths([compiled], (SHIPPED,)), (0.5,))  # ratios need no nearest_budget


def imported_modules(path: Path, package: str, known: set[str]) -> set[str]:
    """The project's modules that `path` (module of package `package`) imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            name = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                found |= {candidate for candidate in (f"{name}.{alias.name}", name) if candidate in known}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
    return found


def test_no_module_of_the_project_imports_itself_back():
    roots = {"kvcompile": ROOT / "kvcompile", "kvruntime": ROOT / "runtime" / "kvruntime"}
    paths = {}
    for top, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    known = set(paths)
    edges = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        # a package's own __init__ is not an edge back: it is what the import of a submodule runs first
        edges[module] = {m for m in imported_modules(path, package, known) if not module.startswith(m + ".")}
    visiting, done = [], set()

    def visit(module: str) -> None:
        assert module not in visiting, f"import loop: {' -> '.join(visiting[visiting.index(module) :] + [module])}"
        if module in done:
            return
        visiting.append(module)
        for other in sorted(edges[module]):
            visit(other)
        visiting.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)


def test_every_folder_of_modules_is_a_package_the_wheels_hold():
    """The packages' discovery (setuptools, both pyproject.toml) leaves a folder without `__init__.py` out of the
    wheel: the checkout imports it as a namespace package, an installed wheel lacks it (CI's `make check-wheel`)."""
    for folder in (ROOT / "kvcompile", ROOT / "runtime" / "kvruntime"):
        modules = {path.parent for path in folder.rglob("*.py")}
        loose = sorted(str(f.relative_to(ROOT)) for f in modules if not (f / "__init__.py").is_file())
        assert not loose, f"folders of modules without __init__.py, missing from the wheel: {loose}"


def test_every_test_has_a_time_limit(request: pytest.FixtureRequest):
    """pytest-timeout is on for the whole suite (pyproject's `timeout`), so a hang fails one test, not CI's run."""
    assert request.config.pluginmanager.hasplugin("timeout")
    assert float(request.config.getini("timeout")) == 600


def test_every_run_replays_the_same_hypothesis_examples():
    """The property tests are derandomized unless KVCOMPILE_FUZZ_SEARCH asks for a new search: the same examples on
    every run, CI's and a loaded machine's alike."""
    from hypothesis import settings

    assert settings.get_profile("replay").derandomize and settings.get_profile("replay").database is None
    assert settings.default.derandomize == (not os.environ.get("KVCOMPILE_FUZZ_SEARCH"))


def test_the_tests_caches_are_their_own():
    """datasets' and matplotlib's caches are the tests' (the processes the tests start inherit them), never the
    user's; `pytest_sessionfinish` fails a run that wrote into ~/.cache/huggingface."""
    import datasets.config

    tests_cache = Path(os.environ["KVCOMPILE_CACHE"])
    assert Path(datasets.config.HF_DATASETS_CACHE).is_relative_to(tests_cache)
    assert Path(os.environ["MPLCONFIGDIR"]).is_relative_to(tests_cache)


def _module_name(path: Path, base: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(base).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imported_modules(path: Path, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module of the project `path` imports, at its top or inside a function, absolute or relative."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            module = ".".join(part for part in (base, node.module or "") if part)
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts:
                found.add(".".join(parts))
    return found


def _import_cycles(top: str, base: Path) -> list[list[str]]:
    """The cycles among `top`'s subpackages and loose modules (each one node): a node that reaches itself."""
    files = {_module_name(path, base): path for path in (base / top).rglob("*.py")}
    known = {name for name, _ in files}
    edges: dict[str, set[str]] = {}
    for (name, is_package), path in files.items():
        node = ".".join(name.split(".")[:2])
        for target in _imported_modules(path, name, is_package, known):
            other = ".".join(target.split(".")[:2])
            if other not in (node, top):  # the package's own API (its __init__) is where everything meets
                edges.setdefault(node, set()).add(other)
    cycles = []
    for start in sorted(edges):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for other in sorted(edges.get(node, ())):
                if other == start:
                    cycles.append(path)
                elif other not in seen:
                    seen.add(other)
                    stack.append((other, [*path, other]))
    return cycles


@pytest.mark.parametrize("top, base", [("kvruntime", ROOT / "runtime"), ("kvcompile", ROOT)])
def test_no_import_cycle_between_packages_even_through_imports_inside_functions(top, base):
    assert _import_cycles(top, base) == []


def test_the_cycle_check_finds_a_cycle_hidden_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    for name, source in {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "def f():\n    from ..b import two\n",
        "b/__init__.py": "",
        "b/two.py": "from pkg.a.one import f\n",
        "c.py": "from .a import one\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(source)
    assert sorted(_import_cycles("pkg", tmp_path)) == [["pkg.a", "pkg.b"], ["pkg.b", "pkg.a"]]


RUNTIME = ROOT / "runtime" / "kvruntime"


def test_no_runtime_module_is_over_350_lines_and_the_top_holds_at_most_10_loose_modules():
    lengths = {path.relative_to(RUNTIME): len(path.read_text().splitlines()) for path in RUNTIME.rglob("*.py")}
    assert {path: lines for path, lines in lengths.items() if lines > 350} == {}
    assert len([path for path in RUNTIME.glob("*.py") if path.name != "__init__.py"]) <= 10


def test_every_benchmark_report_opens_with_the_one_header_helper():
    """Command, machine and date come from `benchmarks.reporting.run_header`, never written by hand."""
    by_hand = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "benchmarks").rglob("*.py")
        if path.name != "reporting.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "Machine: " in line or "Command: `" in line
    ]
    assert by_hand == []
